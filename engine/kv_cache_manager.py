"""Per-request block tables on top of a BlockPool, with prefix-cache lookup (vLLM allocate_slots).

Scheduler protocol for one request:
    blocks, num_cached = kv.get_computed_blocks(token_ids)      # no side effects on refs
    table = kv.allocate_slots(rid, num_tokens, blocks)          # None: wait or preempt
    ... run the model, num_computed_tokens advances ...
    kv.cache_blocks(rid, token_ids, num_computed_tokens)        # make full blocks findable
    kv.allocate_slots(rid, num_tokens + k)                      # grow for decode / next chunk
    kv.free(rid)                                                # finished or preempted
get_computed_blocks and the first allocate_slots must run with no allocation in between,
since a cached block that sits in the free queue may be evicted by any allocate.

With a lower tier (the disk tier, `use_lower_tier`), get_computed_blocks first brings the
blocks of the prompt that the pool lacks and the tier holds into the pool (allocated, read,
cached, freed), then walks the pool as before: the bringing-in allocates before the walk,
never between the walk and allocate_slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.block_hash import hash_block_tokens, salt_root
from engine.block_pool import BlockPool
from engine.kv_events import DEFAULT_CAPACITY, KVEventBuffer
from engine.lower_tier import LowerTier


class KVCacheManager:
    """Owns a BlockPool and maps request id -> block table (block i holds tokens [i*bs, (i+1)*bs))."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        # Chained hashes of the request's first len(...) blocks, all already passed to
        # cache_block; invariant: len(_hashes[rid]) <= len(_tables[rid]), same keys.
        self._hashes: dict[str, list[bytes]] = {}
        self._query_tokens = 0
        self._hit_tokens = 0
        self.lower: LowerTier | None = None
        self.lower_tier_tokens = 0  # prompt tokens brought in from the lower tier, ever

    def use_lower_tier(self, tier: LowerTier) -> None:
        """From now on evicted cached blocks go to `tier` and prompts' missing blocks come
        back from it (engine/lower_tier.py)."""
        self.lower = self.pool.lower = tier

    # -- prefix cache -----------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int], salt: str = "") -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute.
        `salt`: only blocks cached under the same salt match (common/block_hash.salt_root).
        With a lower tier, the run of blocks it holds right after the pool's hits is brought
        into the pool first (when the pool can spare the blocks).

        Returns (block_ids, num_cached_tokens). Reference counts are not changed; pass
        block_ids to allocate_slots to take them.
        """
        blocks: list[int] = []
        if self.enable_prefix_caching:
            # At least one token must be computed to produce logits for the next token.
            max_blocks = max(len(token_ids) - 1, 0) // self.block_size
            parent = salt_root(salt)
            brought_in = self.lower is None
            for i in range(max_blocks):
                parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
                block_id = self.pool.lookup(parent)
                if block_id is None and not brought_in:
                    brought_in = True  # once: a later miss is the tier's miss too, or a gap
                    self._bring_in(blocks, parent, token_ids, i, max_blocks)
                    block_id = self.pool.lookup(parent)
                if block_id is None:
                    break
                blocks.append(block_id)
        num_cached_tokens = len(blocks) * self.block_size
        self._query_tokens += len(token_ids)
        self._hit_tokens += num_cached_tokens
        return blocks, num_cached_tokens

    def num_cached_tokens(self, token_ids: Sequence[int], salt: str = "") -> int:
        """Prompt tokens get_computed_blocks would find now, without counting them in the
        hit-rate stat and without reading the lower tier: the pool's hits, then the blocks
        the tier holds right after them (what it would bring in, if the pool can spare them)."""
        if not self.enable_prefix_caching:
            return 0
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        parent = salt_root(salt)
        tier_used = self.lower is None  # one run from the tier, as _bring_in takes
        in_run = False
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.pool.lookup(parent) is not None:
                in_run = False
            elif (in_run or not tier_used) and self.lower.has(parent):
                tier_used = in_run = True
            else:
                return i * self.block_size
        return max_blocks * self.block_size

    def _bring_in(self, held: list[int], first: bytes, token_ids: Sequence[int], start: int,
                  max_blocks: int) -> None:
        """Blocks `start..` of the prompt (`first` is block `start`'s hash), missing from the
        pool, held by the lower tier: allocate, read, cache them under their hashes, free.
        `held`: the pool's hits before them, pinned meanwhile so the allocation cannot take
        them. A block the tier fails to read ends the run there (the rest are computed)."""
        assert self.lower is not None
        if not self.lower.has(first):
            return
        run = [first]
        parent = first
        for i in range(start + 1, max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.pool.lookup(parent) is not None or not self.lower.has(parent):
                break
            run.append(parent)
        # Skip the bringing-in rather than take blocks the request itself, or the pool's
        # hits it pins, need: a nearly full pool then computes instead of failing.
        pinned_free = sum(1 for b in held if self.pool.ref_count(b) == 0)
        if len(run) > self.pool.num_free_blocks - pinned_free:
            return
        self.pool.touch(held)
        new_blocks = self.pool.allocate(len(run))
        assert new_blocks is not None  # checked above
        loaded = 0
        for block_hash, block_id in zip(run, new_blocks):
            if not self.lower.load(block_hash, block_id):
                break
            self.pool.cache_block(block_id, block_hash)
            loaded += 1
        self.lower_tier_tokens += loaded * self.block_size
        # Freed in the order they should be reused (the free queue's tail goes last): blocks
        # left empty by a failed read, then the prompt's tail, its head last.
        self.pool.free(new_blocks[loaded:])
        self.pool.free(reversed(held + new_blocks[:loaded]))

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                     salt: str = "") -> None:
        """Make every full, computed block of the request findable by its chained hash
        (under `salt`, the request's own, as given to get_computed_blocks).

        Incremental: blocks hashed by an earlier call are skipped.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[request_id]
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        if num_full <= len(hashes):
            return  # no block filled up since the last call (most decode steps)
        table = self._tables[request_id]
        if num_full > len(table):
            raise ValueError(f"request {request_id}: {num_full} full blocks but only {len(table)} allocated")
        parent = hashes[-1] if hashes else salt_root(salt)
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache_block(table[i], parent)
            hashes.append(parent)

    def record_events(self, capacity: int = DEFAULT_CAPACITY) -> KVEventBuffer:
        """From now on record which hashes become findable and which stop being so, in
        order (engine/kv_events.py); returns the buffer, which the caller drains on this
        manager's thread (with `cached_hashes` to start over from when it says `lost`)."""
        if self.pool.events is None:
            self.pool.events = KVEventBuffer(capacity)
        return self.pool.events

    def cached_hashes(self) -> list[bytes]:
        """Every block hash findable now."""
        return self.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes and the hit-rate stat; False (no change) while blocks are in use."""
        if not self.pool.reset_prefix_cache():
            return False
        for hashes in self._hashes.values():
            hashes.clear()  # only requests holding no blocks can remain
        self._query_tokens = self._hit_tokens = 0
        return True

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's block table to cover `num_total_tokens` tokens.

        `computed_blocks` (from get_computed_blocks, first allocation only) are taken as the
        head of the table. Returns the full table, or None, changing nothing, when the pool
        cannot supply the new blocks.
        """
        table = self._tables.get(request_id)
        if table is not None and not computed_blocks:  # a running request grows (every step's case)
            num_new = -(-num_total_tokens // self.block_size) - len(table)
            if num_new > 0:
                new_blocks = self.pool.allocate(num_new)
                if new_blocks is None:
                    return None
                table.extend(new_blocks)
            return list(table)
        if table is not None:
            raise ValueError(f"request {request_id}: computed_blocks are only for the first allocation")
        # The first allocation: the cached head (if any), then new blocks.
        if len(computed_blocks) * self.block_size > num_total_tokens:
            raise ValueError(f"request {request_id}: computed blocks exceed {num_total_tokens} tokens")
        if any(self.pool.block_hash(b) is None for b in computed_blocks):
            raise ValueError(f"request {request_id}: a computed block is no longer cached (allocated in between?)")
        num_new = max(-(-num_total_tokens // self.block_size) - len(computed_blocks), 0)
        # Touching a cached block that sits in the free queue takes it out of the queue,
        # so those blocks are not available for the new allocation.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_new > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(computed_blocks)
        table = self._tables[request_id] = list(computed_blocks)
        # The computed blocks are already cached; remember their hashes as progress.
        self._hashes[request_id] = [self.pool.block_hash(b) for b in computed_blocks]  # all set: checked above
        new_blocks = self.pool.allocate(num_new)
        assert new_blocks is not None  # checked above
        table.extend(new_blocks)
        return list(table)

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first (so shared prefixes are evicted last); unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._hashes[request_id]
        self.pool.free(reversed(table))

    def rename(self, request_id: str, new_id: str) -> None:
        """Hand the request's block table, as it is, to `new_id` (unknown ids are ignored)."""
        if request_id not in self._tables:
            return
        if new_id in self._tables:
            raise ValueError(f"request {new_id}: already holds blocks")
        self._tables[new_id] = self._tables.pop(request_id)
        self._hashes[new_id] = self._hashes.pop(request_id)

    # -- views ------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (KeyError for an unknown request)."""
        return list(self._tables[request_id])

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take (empty or cached with ref 0)."""
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Number of blocks in the pool."""
        return self.pool.num_total_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_total_blocks

    @property
    def num_requests(self) -> int:
        """Requests that currently have a block table."""
        return len(self._tables)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens / queried tokens over all get_computed_blocks calls (0.0 before any)."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    def check_invariants(self) -> None:
        """Assert pool and table bookkeeping agree (used by tests)."""
        self.pool.check_invariants()
        assert self._tables.keys() == self._hashes.keys()
        holders = [0] * self.pool.num_total_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid}: block listed twice"
            assert len(self._hashes[rid]) <= len(table)
            for block_id in table:
                holders[block_id] += 1
        for block_id, n in enumerate(holders):
            assert self.pool.ref_count(block_id) == n, f"block {block_id}: ref != number of tables holding it"
