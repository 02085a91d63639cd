"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flat varlen batch and a paged KV pool.

Projections are fused at load time (q|k|v into one matmul, gate|up into one), and the
LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (float64 stays float64), like the Hugging Face reference."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops,
    ) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        q, k = rotary(positions, q, k)
        attn = paged_attention(ops, q, k, v, k_cache, v_cache, meta, self.scale)
        x = x + self.o_proj(attn.reshape(n, cfg.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm; `compute_logits` applies the LM head to chosen rows."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)
        self.to(dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_model_len, dtype, device)
        self.ops = kernels.get_ops(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, k_cache, v_cache, meta, self.ops)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
