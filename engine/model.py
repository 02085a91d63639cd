"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flat varlen batch and a paged KV pool.

Projections are fused at load time (q|k|v into one matmul, gate|up into one), and the
LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
import kernels.linear
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.rotary import RotaryEmbedding, apply_rotary


class Linear(nn.Linear):
    """nn.Linear whose weight can be packed once for the CPU matmul library (kernels.linear)."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = kernels.linear.pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (float64 stays float64), like the Hugging Face reference.

    Not `F.rms_norm` on bf16 input: that loses the model (SmolLM2 answers gibberish), so
    lower precisions are upcast first.
    """

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
        self.qkv_proj = Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, h, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops,
    ) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = apply_rotary(qk.view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), *cos_sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
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
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)
        self.to(dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_model_len, dtype, device)
        self.ops = kernels.get_ops(device)
        self._head_packed: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, positions, cos_sin, k_cache, v_cache, meta, self.ops)
        return self.norm(x)

    def prepare(self) -> None:
        """After the weights are loaded: pack matmul weights for the CPU kernels."""
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.pack()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._head_packed = kernels.linear.pack_weight(head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.linear.linear(hidden, weight, None, self._head_packed).float()
