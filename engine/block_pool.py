"""Fixed-size KV blocks: reference counts, one LRU free queue, prefix-cache hashes.

A block is in exactly one of three states:
  * in use:          ref > 0, not in the free queue (maybe hashed, i.e. findable);
  * free and cached: ref == 0, in the free queue, hashed; a cache hit revives it;
  * free and empty:  ref == 0, in the free queue, no hash.
The free queue is the LRU: freed blocks join the tail, allocation pops the head, and a
block's hash is dropped only when it is popped for reuse (nano-vllm / vLLM v1 design).

Pure Python and no torch; the hashes are common/block_hash.py's. With `events` set, every
hash that becomes findable or stops being so is recorded there, in order (engine/kv_events.py).
With `lower` set (the disk tier, engine/lower_tier.py), a cached block is handed to it as its
hash is evicted for reuse, while its KV is still intact (a reset of the prefix cache saves
nothing: no block is reused).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from engine.kv_events import KVEventBuffer
from engine.lower_tier import LowerTier


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens, ids 0..num_blocks-1 (no null block)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # Invariant: _hash_of[b] == h  <=>  _block_of[h] == b.
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        # Invariant: keys == {b : _ref[b] == 0}; head = least recently freed = next evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.events: KVEventBuffer | None = None  # set by a worker that publishes its cache
        self.lower: LowerTier | None = None  # where evicted cached blocks go (the disk tier)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0 (empty or cached); all of them can be allocated."""
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        """Number of blocks in the pool."""
        return self._num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0 means it is in the free queue)."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash the block is findable under, or None."""
        return self._hash_of[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks from the head of the free queue (ref 0 -> 1), evicting their hashes.

        Returns None, changing nothing, when fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        if n > len(self._free):
            return None
        blocks: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if self.lower is not None and self._hash_of[block_id] is not None:
                self.lower.save(self._hash_of[block_id], block_id)  # before the step overwrites it
            self._drop_hash(block_id)
            self._ref[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (cache hits); a ref-0 block leaves the free queue."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a holder from each block; those reaching 0 join the free-queue tail in order.

        Hashes survive, so freed blocks stay findable until reused. Raises ValueError,
        changing nothing, if a block would go below 0.
        """
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            if self._ref[block_id] < count:
                raise ValueError(f"block {block_id}: freed {count} times with ref {self._ref[block_id]}")
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under `block_hash` (in use or free), or None."""
        if not self.enable_prefix_caching:
            return None
        return self._block_of.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, in-use block findable under `block_hash`.

        If another block already holds that hash the existing mapping wins and this block
        stays unhashed (two requests computed the same content). No-op when prefix caching
        is off or the block already has this hash.
        """
        if not self.enable_prefix_caching:
            return
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id}: cannot cache a free block")
        current = self._hash_of[block_id]
        if current == block_hash:
            return
        if current is not None:
            # A full block's content never changes while it is held, so neither does its hash.
            raise ValueError(f"block {block_id}: already cached under a different hash")
        if block_hash in self._block_of:
            return
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every hash findable now (the owner thread's view: what a reader of `events` that
        lost its place starts over from)."""
        return list(self._block_of)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False, nothing changes) while any block is in use."""
        if len(self._free) != self._num_blocks:
            return False
        self._block_of.clear()
        self._hash_of = [None] * self._num_blocks
        if self.events is not None:
            self.events.cleared()
        return True

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by tests; O(num_blocks))."""
        assert all(r >= 0 for r in self._ref), "negative refcount"
        free = {b for b, r in enumerate(self._ref) if r == 0}
        assert set(self._free) == free, "free queue != set of ref-0 blocks"
        assert len(self._free) == len(free)
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h, f"hash map points at block {b} which has another hash"
        hashed = sum(h is not None for h in self._hash_of)
        assert hashed == len(self._block_of), "block hash without a hash-map entry"
        if not self.enable_prefix_caching:
            assert not self._block_of

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block_id] = None
            if self.events is not None:
                self.events.removed(block_hash)
