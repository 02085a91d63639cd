"""One layer's multi-head latent attention (DeepSeek's MLA) over a latent KV pool, absorbed:
every head attends to the same per-token entry, [latent (kv_lora_rank) | rotary key], with a
query whose non-rotary part was multiplied into the latent space beforehand (the caller's:
engine/mla.py), and the output is each head's mix of latents (projected back by the caller).
So the pool is read as one "KV head" for all heads, at decode and prefill alike.

The pool holds a token's entry in its K and V planes, half each (engine/config.py's MLA
layout): a layer's `k_cache, v_cache` [num_blocks, block_size, 1, half] read back side by
side are the entries. Torch ops on any device, over the step's metadata as the op sets read
it; float32 math (float64 stays float64).
"""

from __future__ import annotations

import torch

from kernels.attention_step import AttentionMetadata
from kernels.masked_attention import attend, visible


def paged_latent_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, entry]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, 1, half]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs]: read up to each (the query's own entry included)
    scale: float,
    latent: int,
) -> torch.Tensor:  # [num_seqs, num_heads, latent]
    """The decodes' attention: every sequence's entries gathered up to the widest table."""
    entry, block_size = q.shape[-1], k_cache.shape[1]
    n, width = q.shape[0], block_tables.shape[1] * block_size
    keys = _entries(k_cache, v_cache, block_tables.flatten(), entry).view(n, width, 1, entry)
    last = (context_lens - 1)[:, None, None]
    valid = visible(torch.arange(width, device=q.device)[None, None, :], last, None)
    return attend(q[:, None], keys, keys[..., :latent], valid, scale, None)[:, 0]


def latent_attention_step(
    write_kv,  # the op set's write_kv
    q: torch.Tensor,  # [num_tokens, num_heads, entry]: [absorbed query | rotary query]
    k: torch.Tensor,  # [num_tokens, 1, half]: the first half of each new token's entry
    v: torch.Tensor,  # [num_tokens, 1, half]: the second half (padded when the entry is odd)
    k_cache: torch.Tensor,  # [num_blocks, block_size, 1, half]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    latent: int,  # kv_lora_rank: the entry's leading values, which are also the values
    decode=paged_latent_decode,  # the decodes' attention (a kernel's, same signature)
) -> torch.Tensor:  # [num_tokens, num_heads, latent]
    write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
    entry, block_size = q.shape[-1], k_cache.shape[1]
    parts = [decode(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.context_lens, scale, latent)
             for g in meta.decodes]
    for span in meta.prefills:
        s, e, ctx = span.start, span.start + span.num_new, span.context_len
        keys = _entries(k_cache, v_cache, span.block_table, entry)[:ctx][None, :, None]
        q_pos = torch.arange(ctx - span.num_new, ctx, device=q.device)[None, :, None]
        valid = visible(torch.arange(ctx, device=q.device)[None, None, :], q_pos, None)
        parts.append(attend(q[None, s:e], keys, keys[..., :latent], valid, scale, None)[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _entries(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, entry: int) -> torch.Tensor:
    """The entries of `blocks`' tokens, in order: [len(blocks) * block_size, entry]."""
    halves = torch.cat([k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)], dim=-1)
    return halves.flatten(0, 2)[:, :entry]
