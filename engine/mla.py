"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV pool.

A token's KV is one entry per layer: the latent (`kv_a_proj_with_mqa`'s first kv_lora_rank
outputs, RMS-normed) and the rotary key (the rest, rotated), the same for every head. The
pool keeps the entry as it is (engine/config.py: its K and V planes hold one half each), so
a push, a migration, the prefix cache and the disk tier move latents. Attention is absorbed
at decode and prefill alike: each head's non-rotary query is multiplied by its slice of
`kv_b_proj`'s key part into the latent space, so a head's score for a token is one dot
product with the entry; the heads' mixes of latents then go through `kv_b_proj`'s value part
(kernels/latent_attention.py; the math transformers does by expanding every latent into
per-head keys and values first, associated the other way).

Under tensor parallelism a rank holds its heads' query and `kv_b_proj` rows and o_proj's
matching input columns; the latent projection, its norm and so the pool's entries are every
rank's whole (one "KV head", replicated).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from kernels.attention_step import AttentionMetadata
from kernels.op_set import OpSet

NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (DeepSeek's, not the config's rms_norm_eps)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: type[nn.Linear], norm: type[nn.Module]):
        super().__init__()
        m = cfg.mla
        self.cfg, self.m = cfg, m
        heads, h = cfg.num_heads, cfg.hidden_size
        if m.q_lora_rank is None:
            self.q_proj = linear(h, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = linear(h, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = norm(m.q_lora_rank, NORM_EPS)
            self.q_b_proj = linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = linear(h, m.entry_size, bias=cfg.qkv_bias)
        self.kv_a_layernorm = norm(m.kv_lora_rank, NORM_EPS)
        # read as a weight (absorbed into the query and the output), never as a matmul: a plain
        # nn.Linear, which the model's prepare() does not pack
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        # DeepSeek's rotary dimensions come in pairs: evens first, then odds, is the rotate-half
        # layout the op set's rotary takes (the same permutation of q and k: the same scores)
        pairs = torch.cat([torch.arange(0, m.qk_rope_head_dim, 2), torch.arange(1, m.qk_rope_head_dim, 2)])
        self.register_buffer("pairs", pairs if m.rope_interleave else None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden], normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [n, 1, qk_rope_head_dim] each
        k_cache: torch.Tensor,  # [num_blocks, block_size, 1, half]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: OpSet,
    ) -> torch.Tensor:  # [n, heads * v_head_dim]: o_proj's input
        m, n, heads = self.m, x.shape[0], self.cfg.num_heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(n, heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.pairs is not None:
            q_rot, k_rot = q_rot.index_select(-1, self.pairs), k_rot.index_select(-1, self.pairs)
        q_rot = ops.rotary(q_rot.contiguous(), *cos_sin)
        k_rot = ops.rotary(k_rot.contiguous()[:, None], *cos_sin)[:, 0]
        entry = torch.cat([latent, k_rot], dim=-1)  # [n, entry_size]: what the pool keeps
        half = k_cache.shape[-1]
        if 2 * half != m.entry_size:
            entry = nn.functional.pad(entry, (0, 2 * half - m.entry_size))
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w[:, :m.qk_nope_head_dim])
        query = torch.cat([q_latent, q_rot], dim=-1)  # [n, heads, entry_size]
        mixed = ops.latent_attention_step(query, entry[:, None, :half], entry[:, None, half:], k_cache, v_cache,
                                          meta, m.softmax_scale, m.kv_lora_rank)  # [n, heads, kv_lora_rank]
        out = torch.einsum("nhl,hvl->nhv", mixed, w[:, m.qk_nope_head_dim:])
        return out.reshape(n, heads * m.v_head_dim)
