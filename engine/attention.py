"""Paged attention over a flattened (varlen) batch, dispatched to kernels/.

A step's tokens are laid out decodes first (one token each), then prefill chunks. Each
token's K/V is written into its slot of the paged pool before attention, so a query
always reads its whole context, new tokens included, from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One prefill chunk: tokens [start, start + num_new) of the flat batch."""

    start: int
    num_new: int
    context_len: int  # tokens of context after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class DecodeGroup:
    """Single-token queries [start, end) of the flat batch, padded to a common context width."""

    start: int
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = valid key position


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_blocks: torch.Tensor  # [num_tokens] block id per new token
    slot_offsets: torch.Tensor  # [num_tokens] offset within the block
    decodes: list[DecodeGroup]  # the first tokens of the batch, grouped by context length
    prefills: list[PrefillSpan]


# What one more attention call per layer costs, in padded key positions (measured on
# SmolLM2 shapes: ~0.1 ms of fixed cost per call vs ~0.3 us per gathered position).
GROUP_OVERHEAD_POSITIONS = 256


def group_by_length(lengths: list[int], overhead: int = GROUP_OVERHEAD_POSITIONS) -> list[tuple[int, int]]:
    """Split ascending context lengths into runs [i, j) minimising padded positions + overhead.

    One padded batch over a mix of short and long contexts gathers every sequence up to the
    longest; a few groups of similar lengths read far less. Exact DP, O(n^2) for n decodes.
    """
    n = len(lengths)
    best = [0] + [0] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (j - i) * lengths[j - 1] + overhead, i) for i in range(j))
    groups, j = [], n
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def build_decode_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """True for key positions < context_len, False beyond (the padding of shorter tables)."""
    valid = torch.arange(width)[None, :] < context_lens[:, None]
    return valid[:, None, None, :]


def paged_attention(
    ops,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    ops.write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
    parts = []
    for g in meta.decodes:
        parts.append(ops.decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.mask, scale))
    for span in meta.prefills:
        s, e = span.start, span.start + span.num_new
        if span.context_len == span.num_new:  # no cached prefix: the chunk is its own context
            kc, vc = k[s:e], v[s:e]
        else:
            kc = ops.gather_context(k_cache, span.block_table, span.context_len)
            vc = ops.gather_context(v_cache, span.block_table, span.context_len)
        parts.append(ops.prefill_attention(q[s:e], kc, vc, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
