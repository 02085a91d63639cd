"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; with experts, Qwen3-MoE, Mixtral
and gpt-oss, whose attention adds sinks and a window on some layers) over a flat varlen
batch and a paged KV pool.

Projections are fused at load time (q|k|v into one matmul, gate|up into one), and the
LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import kernels
import kernels.linear
import kernels.reference
from engine.config import ModelConfig
from engine.mla import LatentAttention
from engine.moe import SparseMoe
from engine.mtp import MtpLayer
from engine.rotary import RotaryEmbedding
from kernels.attention_step import AttentionMetadata
from kernels.op_set import OpSet


class Linear(nn.Linear):
    """nn.Linear whose weight can be packed once for the CPU matmul library (kernels.linear)."""

    packed: kernels.linear.PackedWeight | None = None

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (0.5 s of SmolLM2's start)."""

    def pack(self, library=None) -> None:
        if self.weight is None:  # packed already, its unpacked weight dropped
            return
        self.packed = kernels.linear.pack_weight(self.weight, library)
        if self.packed is not None and self.packed.serves_every_x:
            self.weight = None  # one copy of the weights in memory, not two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    """Holds the norm's weight and eps; the math is the op set's `rms_norm` / `add_rms_norm`
    (kernels.reference on CPU: float32 math, like the Hugging Face reference)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.reference.rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        # DeepSeek: latent attention (engine/mla.py) in place of q|k|v; o_proj either way
        self.mla = LatentAttention(cfg, Linear, RMSNorm) if cfg.mla is not None else None
        if self.mla is None:
            self.qkv_proj = Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        o_inputs = cfg.num_heads * cfg.mla.v_head_dim if cfg.mla is not None else cfg.q_size
        self.o_proj = Linear(o_inputs, h, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        # the MLP: dense, or a mixture of experts on the layers the config names (engine/moe.py);
        # a multi-token-prediction layer (past the decoder's: engine/mtp.py) as the last layer
        sparse = cfg.moe is not None and (index in cfg.moe.sparse_layers or
                                          (index >= cfg.num_layers and cfg.num_layers - 1 in cfg.moe.sparse_layers))
        self.moe = SparseMoe(h, cfg.moe, Linear) if sparse else None
        if self.moe is None:
            self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        # Qwen3: each q and k head RMS-normed over head_dim before rotary (one weight per kind)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # gpt-oss: a window on some layers, and a learned logit per head in every softmax
        self.window = cfg.sliding_window if index in cfg.window_layers else None
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (layer 0: embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the residual stream before x; None at layer 0
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: OpSet,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [num_tokens, hidden]
        """The residual adds are fused into the next norm: `add_rms_norm(x, residual)` is
        (norm(residual + x), residual + x), the same numbers as adding first."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        if self.mla is not None:
            attn = self.mla(h, cos_sin, k_cache, v_cache, meta, ops)
        else:
            attn = self._attention(h, cos_sin, k_cache, v_cache, meta, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(self.o_proj(attn), residual, norm.weight, norm.eps)
        if self.moe is not None:
            return self.moe(h, ops), residual
        return self.down_proj(ops.silu_mul(self.gate_up_proj(h))), residual

    def _attention(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, ops: OpSet) -> torch.Tensor:  # [n, q_size]
        cfg, n = self.cfg, h.shape[0]
        qkv = self.qkv_proj(h)
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = ops.rotary(qk, *cos_sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.window is None and self.sinks is None:
            attn = ops.attention_step(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            attn = ops.masked_attention_step(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.sinks)
        return attn.reshape(n, cfg.q_size)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm; `compute_logits` applies the LM head to chosen rows.
    `mtp`: also build the checkpoint's multi-token-prediction layers (engine/mtp.py), which
    the forward pass does not run."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu", mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        # the weight given (uninitialised), not drawn at random: the checkpoint's replaces it
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.mtp = nn.ModuleList(MtpLayer(cfg, DecoderLayer(cfg, cfg.num_layers + i), Linear, RMSNorm)
                                 for i in range(cfg.mtp_layers if mtp else 0))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)
        self.to(dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_model_len, dtype, device)
        self.ops = kernels.get_ops(device)
        self._head_packed: kernels.linear.PackedWeight | None = None
        # Called after every decoder layer when set: a worker's chance to make progress on
        # other work (e.g. NIXL transfers whose peers wait on this process) during a step.
        self.between_layers: Callable[[], None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.rotary.cos_sin(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos_sin, k_cache, v_cache, meta, self.ops)
            if self.between_layers is not None:
                self.between_layers()
        if residual is None:  # a model without layers
            return self.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder's layers, then the multi-token-prediction layers' (where built)."""
        return [*self.layers, *(m.layer for m in self.mtp)]

    def leaves_out(self, target: str) -> bool:
        """Whether a checkpoint tensor with no place here is one this model leaves to another
        rank (an expert it does not hold), rather than a mismatch."""
        return False

    def prepare(self) -> None:
        """After the weights are loaded: pack matmul weights for the CPU kernels (a layer whose
        packed copies serve every row count then drops its unpacked weight)."""
        library = self.ops.matmul_library()
        for layer in self.decoder_layers():  # first: a backend that stacks the experts' weights packs none of them
            if layer.moe is not None:
                self.ops.prepare_experts(layer.moe)
        for module in [*self.layers.modules(), *self.mtp.modules()]:
            if isinstance(module, Linear):
                module.pack(library)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._head_packed = kernels.linear.pack_weight(head, library)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.linear.linear(hidden, weight, None, self._head_packed).float()
