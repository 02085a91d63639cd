"""What the block pool and the KV manager know of a tier below the KV pool (the disk tier,
engine/disk_tier.py): blocks go down when the pool evicts them and come back up on a
prefix-cache hit. The pool and the manager stay torch-free: they pass block ids and block
hashes; the tier reads and writes the pool's tensor itself.
"""

from __future__ import annotations

from typing import Protocol


class LowerTier(Protocol):
    """A store of KV blocks keyed by their chained hash (common/block_hash.py), called on
    the engine's thread only."""

    def save(self, block_hash: bytes, block_id: int) -> None:
        """The pool is about to reuse `block_id`, cached under `block_hash`: copy its KV
        now (the next step overwrites it) and keep it. Never blocks on I/O: a tier that is
        behind drops the save (and counts it)."""

    def has(self, block_hash: bytes) -> bool:
        """Whether `load` may find the block (it may still fail its checks)."""

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Write the block kept under `block_hash` into pool block `block_id`. False, the
        pool block's content undefined, when it is missing or fails its checks (such an
        entry is deleted and counted, never served)."""
