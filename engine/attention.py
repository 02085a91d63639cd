"""Paged attention over a flattened (varlen) batch, dispatched to kernels/.

A step's tokens are laid out decodes first (one token each), then prefill chunks. Each
token's K/V is written into its slot of the paged pool before attention, so a query
always reads its whole context, new tokens included, from the pool.

The torch ops (CPU) take decodes in groups of similar context length and prefill chunks
one by one; the native op set (CPU) reads the pool in place, all decodes in one call
(DECODE_IN_PLACE) and all prefill chunks in another (PREFILL_IN_PLACE); batched op sets
(the Triton kernels on CUDA) take all decodes in one call and all prefill chunks in
another. The varlen calls read `VarlenMetadata`, derived once per step on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


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
    context_lens: torch.Tensor  # [n] int64
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool, True = valid key position
    # (None for op sets that read the blocks in place: DECODE_IN_PLACE)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_blocks: torch.Tensor  # [num_tokens] block id per new token
    slot_offsets: torch.Tensor  # [num_tokens] offset within the block
    decodes: list[DecodeGroup]  # the first tokens of the batch, grouped by context length
    prefills: list[PrefillSpan]
    varlen: VarlenMetadata | None = field(default=None, repr=False)  # batched ops only; cached


@dataclass
class VarlenMetadata:
    """The step's attention as two varlen batches, for batched op sets (no host sync)."""

    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int64, from the first prefill token
    prefill_context_lens: torch.Tensor  # [num_prefills] int64
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks], padded with block 0
    max_prefill_len: int

    @classmethod
    def of(cls, meta: AttentionMetadata) -> VarlenMetadata:
        """Built once per step (on the first layer) and cached on `meta`."""
        if meta.varlen is None:
            meta.varlen = cls._build(meta)
        return meta.varlen

    @classmethod
    def _build(cls, meta: AttentionMetadata) -> VarlenMetadata:
        device = meta.slot_blocks.device
        no_rows = torch.zeros(0, 1, dtype=torch.int64, device=device)
        groups, spans = meta.decodes, meta.prefills
        width = max((g.block_tables.shape[1] for g in groups), default=1)
        decode_tables = [F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups]
        cu = [0]
        for span in spans:
            cu.append(cu[-1] + span.num_new)
        return cls(
            num_decodes=groups[-1].end if groups else 0,
            decode_block_tables=torch.cat(decode_tables) if groups else no_rows,
            # a decode's context length is its number of valid key positions
            decode_context_lens=torch.cat([g.context_lens for g in groups]) if groups else no_rows[:, 0],
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
            prefill_context_lens=torch.tensor([s.context_len for s in spans], dtype=torch.int64, device=device),
            prefill_block_tables=pad_sequence([s.block_table for s in spans], batch_first=True) if spans else no_rows,
            max_prefill_len=max((s.num_new for s in spans), default=0),
        )


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
    if ops.BATCHED:
        return _batched_attention(ops, q, k_cache, v_cache, VarlenMetadata.of(meta), scale)
    parts = []
    in_place = getattr(ops, "DECODE_IN_PLACE", False)
    for g in meta.decodes:
        if in_place:
            parts.append(ops.paged_decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_tables,
                                                    g.context_lens, scale))
        else:
            parts.append(ops.decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.mask, scale))
    if meta.prefills and getattr(ops, "PREFILL_IN_PLACE", False):  # every chunk in one call
        vm = VarlenMetadata.of(meta)
        parts.append(ops.paged_prefill_attention(q[vm.num_decodes:], k_cache, v_cache, vm.prefill_cu_seqlens,
                                                 vm.prefill_context_lens, vm.prefill_block_tables,
                                                 vm.max_prefill_len, scale))
    else:
        for span in meta.prefills:
            s, e = span.start, span.start + span.num_new
            if span.context_len == span.num_new:  # no cached prefix: the chunk is its own context
                kc, vc = k[s:e], v[s:e]
            else:
                kc = ops.gather_context(k_cache, span.block_table, span.context_len)
                vc = ops.gather_context(v_cache, span.block_table, span.context_len)
            parts.append(ops.prefill_attention(q[s:e], kc, vc, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _batched_attention(ops, q, k_cache, v_cache, vm: VarlenMetadata, scale: float) -> torch.Tensor:
    """All decodes in one call, all prefill chunks in another, into one output."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_heads, head_dim]
    nd = vm.num_decodes
    if nd:
        ops.paged_decode_attention(q[:nd], k_cache, v_cache, vm.decode_block_tables, vm.decode_context_lens,
                                   scale, out=out[:nd])
    if nd < q.shape[0]:
        ops.paged_prefill_attention(q[nd:], k_cache, v_cache, vm.prefill_cu_seqlens, vm.prefill_context_lens,
                                    vm.prefill_block_tables, vm.max_prefill_len, scale, out=out[nd:])
    return out
