"""The step's input tensors, allocated once and filled in place every step.

A step hands the model token ids, positions, each new token's KV slot (block and offset)
and, for its decodes, a block table and a context length per sequence. Building those as
fresh tensors from Python lists every step allocates a dozen small tensors and pads every
block table to the batch's widest; here each input is one persistent buffer, sized from
the scheduler's bounds, written through a numpy view of the same memory, and handed to
the model as a view of its first rows. Decode block tables keep the full width of the
longest allowed context (`max_blocks`): a row is rewritten only up to its sequence's
blocks, and the kernels read a row only up to its context length.

Fixed storage is also what graph capture needs (CUDA graphs replay against the same
addresses). On the CPU the views cover the real batch: a padded row would be computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepLimits:
    """What one step may hold: the scheduler's token and sequence caps, and the widest table."""

    max_tokens: int
    max_seqs: int
    max_blocks: int  # blocks of the longest allowed context


@dataclass
class StepInputs:
    """Views of the buffers' first rows for one step (valid until the next `fill`)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64; past a row's blocks: stale ids
    decode_context_lens: torch.Tensor  # [num_decodes] int64


class StepBuffers:
    def __init__(self, limits: StepLimits, block_size: int):
        self.block_size = block_size
        self.limits = limits
        self._allocate(limits)

    def _allocate(self, limits: StepLimits) -> None:
        self.limits = limits
        self._tokens = torch.zeros(4, limits.max_tokens, dtype=torch.int64)  # ids, positions, blocks, offsets
        self._tables = torch.zeros(limits.max_seqs, limits.max_blocks, dtype=torch.int64)
        self._lens = torch.zeros(limits.max_seqs, dtype=torch.int64)
        self._tokens_np, self._tables_np, self._lens_np = self._tokens.numpy(), self._tables.numpy(), self._lens.numpy()

    def _fit(self, num_tokens: int, num_decodes: int, widest: int) -> None:
        """Grow (never on a step the limits allow) if a step exceeds the buffers."""
        lim = self.limits
        if num_tokens > lim.max_tokens or num_decodes > lim.max_seqs or widest > lim.max_blocks:
            self._allocate(StepLimits(max(num_tokens, lim.max_tokens), max(num_decodes, lim.max_seqs),
                                      max(widest, lim.max_blocks)))

    def fill(self, ids: list[int], positions: list[int], slot_blocks: list[int],
             decode_tables: list[list[int]], decode_lens: list[int]) -> StepInputs:
        """Write one step's inputs; the decodes are the first len(decode_tables) tokens."""
        n, nd = len(ids), len(decode_tables)
        self._fit(n, nd, max(map(len, decode_tables), default=0))
        tok = self._tokens_np
        tok[0, :n] = ids
        tok[1, :n] = positions
        tok[2, :n] = slot_blocks
        np.remainder(tok[1, :n], self.block_size, out=tok[3, :n])
        tables = self._tables_np
        for row, table in enumerate(decode_tables):
            tables[row, : len(table)] = table
        self._lens_np[:nd] = decode_lens
        t = self._tokens
        return StepInputs(t[0, :n], t[1, :n], t[2, :n], t[3, :n], self._tables[:nd], self._lens[:nd])
