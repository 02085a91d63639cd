"""Torch reference ops for paged attention (CPU production path, and the oracle for kernels).

KV pool layout (see engine/kv_cache.py): per layer a view `k_cache, v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
`block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,  # [num_tokens] block id of each new token
    slot_offsets: torch.Tensor,  # [num_tokens] offset inside that block
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
) -> None:
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64, padded with any valid id
    mask: torch.Tensor,  # [num_seqs, 1, 1, max_blocks * block_size] bool: key position is valid
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    width = mask.shape[-1]
    # index_select on the block dimension is several times faster than advanced indexing here.
    flat = block_tables.flatten()
    k = k_cache.index_select(0, flat).view(num_seqs, width, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(num_seqs, width, kv_heads, head_dim).transpose(1, 2)
    # Grouped-query attention: each KV head serves `group` query heads, as `group` query rows.
    q = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,  # [num_new, num_heads, head_dim]: the chunk's queries
    k: torch.Tensor,  # [ctx, kv_heads, head_dim]: the whole context, chunk included, in order
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """Causal attention of a chunk whose queries are the last `num_new` of `ctx` positions."""
    num_new, ctx = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_new == ctx:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(ctx - num_new, ctx)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]  # [num_new, ctx]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [n_blocks] int64
    ctx: int,
) -> torch.Tensor:  # [ctx, kv_heads, head_dim]
    return cache.index_select(0, block_table).flatten(0, 1)[:ctx]
