"""Registered scratch memory where a tensor-parallel sender packs the heads a receiving
rank holds into that rank's block layout, so a push between workers of different degrees
writes whole blocks, one NIXL region each, instead of one region per (layer, K/V, token)
row and run of heads (measured 35-100x slower: bench/RESULTS.md).

    staging = Staging(agent.nixl, capacity_bytes)
    at = staging.take(num_bytes)          # an offset, or None while full (the chunk waits)
    view = staging.view(at, shape, dtype) # pack into it (transfer/ranks.py pack_blocks)
    staging.give_back(at)                 # once the write that reads it ended

First fit over a sorted free list: a push's chunks take a few blocks each and give them back
as their writes end, so the list stays short.
"""

from __future__ import annotations

import bisect

import torch

DEFAULT_CAPACITY = 64 << 20
ALIGN = 4096


class Staging:
    def __init__(self, nixl, capacity_bytes: int = DEFAULT_CAPACITY, device: torch.device | str = "cpu"):
        """On the pools' device: packing is a copy there, and the write reads it as the pools' kind."""
        self.capacity = capacity_bytes
        self.buffer = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)  # touched now: no page faults
        self._registration = nixl.register_memory(self.buffer)
        self._nixl = nixl
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, length), by offset
        self._taken: dict[int, int] = {}  # offset -> length

    @property
    def base_addr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def bytes_taken(self) -> int:
        return sum(self._taken.values())

    def take(self, num_bytes: int) -> int | None:
        """An offset of `num_bytes` free bytes (aligned), or None while not enough are free
        in one run. ValueError past the whole capacity: such a write can never be staged."""
        size = -(-num_bytes // ALIGN) * ALIGN
        if size > self.capacity:
            raise ValueError(f"{num_bytes} bytes to stage, more than the staging area's {self.capacity}")
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                self._taken[offset] = size
                return offset
        return None

    def give_back(self, offset: int) -> None:
        size = self._taken.pop(offset)
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:  # merge with the next
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        return self.buffer[offset:offset + n].view(dtype).view(shape)

    def close(self) -> None:
        self._nixl.deregister_memory(self._registration)
