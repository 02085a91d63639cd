"""One engine step's attention inputs, as the runner hands them to an op set.

A step's tokens are laid out decodes first (one token each, ascending context length),
then prefill chunks. Each token's K/V is written into its slot of the paged pool before
attention, so a query always reads its whole context, new tokens included, from the pool.

The runner builds `AttentionMetadata` once per step (the decodes grouped by the op set's
`plan_decodes`); every layer's `attention_step` reads it. Op sets that take the step's
decodes and prefill chunks in one call each read it as `VarlenMetadata`, derived on the
first layer and cached.
"""

from __future__ import annotations

import dataclasses
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
    block_tables: torch.Tensor  # [n, max_blocks] int64; past a row's blocks: padding or stale ids
    context_lens: torch.Tensor  # [n] int64
    mask: torch.Tensor | None = None  # [n, 1, 1, max_blocks * block_size] bool, True = valid key
    # position; only for op sets that gather padded contexts (the torch ops)


@dataclass(frozen=True)
class StepDecodes:
    """The step's decodes as the runner's step buffers hold them (host tensors), in
    ascending context length: what `OpSet.plan_decodes` groups."""

    block_tables: torch.Tensor  # [num_decodes, max_blocks] int64; past a row's blocks: stale ids
    context_lens: torch.Tensor  # [num_decodes] int64
    lengths: list[int]  # the context lengths again, as ints
    widths: list[int]  # blocks in each decode's table
    block_size: int

    def __len__(self) -> int:
        return len(self.lengths)

    def group(self, start: int, end: int, device: torch.device | str) -> DecodeGroup:
        """Decodes [start, end) as one group on `device`, tables cut to the group's widest
        (one contiguous copy per step: a strided view would be copied by every layer's call)."""
        width = max(self.widths[start:end])
        tables = self.block_tables[start:end, :width].contiguous()
        return DecodeGroup(start, end, tables.to(device), self.context_lens[start:end].to(device))

    def masked_group(self, start: int, end: int, device: torch.device | str) -> DecodeGroup:
        """`group` with the mask of each row's valid key positions."""
        g = self.group(start, end, device)
        width = max(self.widths[start:end]) * self.block_size
        mask = build_decode_mask(self.context_lens[start:end], width).to(device)
        return dataclasses.replace(g, mask=mask)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_blocks: torch.Tensor  # [num_tokens] block id per new token
    slot_offsets: torch.Tensor  # [num_tokens] offset within the block
    decodes: list[DecodeGroup]  # the first tokens of the batch, as the op set grouped them
    prefills: list[PrefillSpan]
    varlen: VarlenMetadata | None = field(default=None, repr=False)  # built on first use, cached


@dataclass
class VarlenMetadata:
    """The step's attention as two varlen batches: every decode, every prefill chunk (no host sync)."""

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
