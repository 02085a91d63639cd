"""KVCacheManager: allocate_slots / prefix hits / cache_blocks / free, plus a stateful model check."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.block_hash import block_hashes
from engine.kv_cache_manager import KVCacheManager


def run_prefill(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request as the scheduler would, compute all of it, and cache its full blocks."""
    computed, _ = kv.get_computed_blocks(tokens)
    table = kv.allocate_slots(rid, len(tokens), computed)
    assert table is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    return table


def test_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(8, 4)
    run_prefill(kv, "a", list(range(8)))
    a = kv.block_table("a")
    assert kv.get_computed_blocks(list(range(8))) == (a[:1], 4)  # 8 cached, but 1 must be computed
    assert kv.get_computed_blocks(list(range(9))) == (a[:2], 8)
    assert kv.get_computed_blocks([]) == ([], 0)
    assert kv.get_computed_blocks([0, 1, 2, 3, 99, 5, 6, 7, 8]) == (a[:1], 4)  # chain stops at a miss


def test_a_salted_prefix_is_found_only_under_the_same_salt():
    kv = KVCacheManager(16, 4)
    tokens = list(range(13))
    computed, _ = kv.get_computed_blocks(tokens, "tenant:a")
    table = kv.allocate_slots("a", len(tokens), computed)
    kv.cache_blocks("a", tokens, len(tokens), "tenant:a")
    assert kv.get_computed_blocks(tokens, "tenant:a") == (table[:3], 12)
    assert kv.get_computed_blocks(tokens, "tenant:b") == ([], 0)
    assert kv.get_computed_blocks(tokens) == ([], 0)  # unsalted is its own space too
    assert kv.num_cached_tokens(tokens, "tenant:a") == 12 and kv.num_cached_tokens(tokens) == 0
    assert block_hashes(tokens, 4, "tenant:a") == [kv.pool.block_hash(b) for b in table[:3]]  # the router's key
    assert block_hashes(tokens, 4) != block_hashes(tokens, 4, "tenant:a")


def test_shared_prefix_refcounts():
    kv = KVCacheManager(8, 2)
    a = run_prefill(kv, "a", [1, 2, 3, 4, 5])
    b = run_prefill(kv, "b", [1, 2, 3, 4, 9])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [kv.pool.ref_count(x) for x in a[:2]] == [2, 2]
    kv.free("a")
    assert [kv.pool.ref_count(x) for x in a] == [1, 1, 0]
    assert kv.num_free_blocks == 8 - 3
    kv.check_invariants()
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_free_releases_tail_first_so_prefixes_live_longest():
    kv = KVCacheManager(6, 2)
    a = run_prefill(kv, "a", [1, 2, 3, 4, 5, 6])
    assert a == [0, 1, 2]
    kv.free("a")
    # Free queue is now 3, 4, 5 (never used), then 2, 1, 0.
    assert kv.allocate_slots("fill", 8) == [3, 4, 5, 2]
    assert kv.get_computed_blocks([1, 2, 3, 4, 5, 6, 7]) == ([0, 1], 4)
    kv.free("fill")
    kv.check_invariants()


def test_full_returns_none_and_changes_nothing_counting_revived_blocks():
    kv = KVCacheManager(4, 2)
    run_prefill(kv, "a", [1, 2, 3, 4])
    kv.free("a")  # both blocks free but cached
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 5 blocks: 2 cached + 3 new, only 2 left besides the hits
    computed, n = kv.get_computed_blocks(tokens)
    assert n == 4 and kv.num_free_blocks == 4
    assert kv.allocate_slots("b", len(tokens), computed) is None
    assert kv.num_free_blocks == 4 and kv.num_requests == 0
    assert all(kv.pool.ref_count(x) == 0 for x in range(4))
    assert kv.get_computed_blocks(tokens) == (computed, 4)  # hits survived
    kv.check_invariants()
    # 4 blocks: 2 hits + 2 new fits exactly.
    table = kv.allocate_slots("b", 7, computed)
    assert table is not None and table[:2] == computed and kv.num_free_blocks == 0
    assert kv.allocate_slots("b", 9) is None
    assert kv.block_table("b") == table
    kv.free("b")
    assert kv.num_free_blocks == 4
    kv.check_invariants()


def test_grow_and_incremental_cache_blocks():
    kv = KVCacheManager(8, 4)
    tokens = list(range(6))
    assert kv.allocate_slots("a", 6) == [0, 1]
    assert kv.allocate_slots("a", 8) == [0, 1]  # still fits in two blocks
    kv.cache_blocks("a", tokens, 3)  # first block not complete yet
    assert kv.pool.lookup(block_hashes(tokens, 4)[0]) is None
    kv.cache_blocks("a", tokens, 6)
    assert kv.pool.lookup(block_hashes(tokens, 4)[0]) == 0
    tokens += [6, 7, 8]
    assert kv.allocate_slots("a", 9) == [0, 1, 2]
    kv.cache_blocks("a", tokens, 9)
    assert [kv.pool.lookup(h) for h in block_hashes(tokens, 4)] == [0, 1]
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 12, [0])  # computed blocks only on the first allocation
    kv.free("a")
    kv.check_invariants()


def test_duplicate_content_keeps_first_mapping():
    kv = KVCacheManager(8, 2)
    tokens = [7, 7, 8, 8, 9]
    a = kv.allocate_slots("a", 5)
    b = kv.allocate_slots("b", 5)  # computed concurrently: no hit yet
    kv.cache_blocks("a", tokens, 5)
    kv.cache_blocks("b", tokens, 5)
    kv.free("a")
    kv.free("b")
    assert kv.get_computed_blocks(tokens) == (a[:2], 4)
    assert all(kv.pool.block_hash(x) is None for x in b)
    kv.check_invariants()


def test_stats_usage_and_reset():
    kv = KVCacheManager(4, 2)
    assert kv.prefix_cache_hit_rate == 0.0 and kv.usage == 0.0
    run_prefill(kv, "a", [1, 2, 3, 4, 5])  # 5 queried, 0 hit
    run_prefill(kv, "b", [1, 2, 3, 4, 6])  # 5 queried, 4 hit
    assert kv.prefix_cache_hit_rate == pytest.approx(4 / 10)
    assert kv.usage == pytest.approx(4 / 4) and kv.num_requests == 2
    assert kv.reset_prefix_cache() is False
    kv.free("a")
    kv.free("b")
    kv.free("nobody")  # unknown: no-op
    assert kv.num_requests == 0 and kv.usage == 0.0
    assert kv.reset_prefix_cache() is True
    assert kv.prefix_cache_hit_rate == 0.0
    assert kv.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)
    kv.check_invariants()


def test_prefix_caching_disabled_always_misses():
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    run_prefill(kv, "a", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)
    assert kv.prefix_cache_hit_rate == 0.0
    assert all(kv.pool.block_hash(x) is None for x in range(4))
    kv.free("a")
    kv.check_invariants()


@dataclass
class Req:
    tokens: list[int]
    num_computed: int
    table: list[int]


class ManagerMachine(RuleBasedStateMachine):
    """Random admit (with shared prefixes) / compute+cache / grow / free / evict / reset."""

    NUM_BLOCKS = 12
    BLOCK_SIZE = 2
    CACHING = True
    tokens_st = st.lists(st.integers(0, 2), max_size=6)

    @initialize()
    def setup(self):
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.BLOCK_SIZE, self.CACHING)
        self.reqs: dict[str, Req] = {}
        self.history: list[list[int]] = [[]]  # token lists seen, to draw shared prefixes from
        self.content: dict[int, tuple[int, ...]] = {}  # block -> full token prefix it ends, when cached
        self.next_id = 0

    def _snapshot(self):
        refs = [self.kv.pool.ref_count(b) for b in range(self.NUM_BLOCKS)]
        hashes = [self.kv.pool.block_hash(b) for b in range(self.NUM_BLOCKS)]
        return self.kv.num_free_blocks, refs, hashes, self.kv.num_requests

    def _admit(self, tokens: list[int]) -> str | None:
        bs = self.BLOCK_SIZE
        computed, n = self.kv.get_computed_blocks(tokens)
        assert n == len(computed) * bs and n <= max(len(tokens) - 1, 0)
        if not self.CACHING:
            assert computed == []
        for i, b in enumerate(computed):  # a hit must hold exactly this prefix
            assert self.content[b] == tuple(tokens[: (i + 1) * bs])
        before = self._snapshot()
        num_revived = sum(self.kv.pool.ref_count(b) == 0 for b in computed)
        rid = f"r{self.next_id}"
        self.next_id += 1
        table = self.kv.allocate_slots(rid, len(tokens), computed)
        num_new = -(-len(tokens) // bs) - len(computed)
        if table is None:
            assert num_new > before[0] - num_revived
            assert self._snapshot() == before
            return None
        assert table[: len(computed)] == computed and len(table) == -(-len(tokens) // bs)
        self.reqs[rid] = Req(list(tokens), n, table)
        self.history.append(list(tokens))
        return rid

    @rule(data=st.data(), tail=tokens_st)
    def admit(self, data, tail):
        base = data.draw(st.sampled_from(self.history))
        prefix = base[: data.draw(st.integers(0, len(base)))]
        tokens = prefix + tail
        if tokens:
            self._admit(tokens)

    @rule(data=st.data(), over=st.booleans())
    def admit_at_capacity(self, data, over):
        # A prompt sized to need exactly the blocks left (or one more) once its hits that sit
        # in the free queue are revived: the boundary where that accounting matters.
        bs = self.BLOCK_SIZE
        base = data.draw(st.sampled_from(self.history))
        prefix = base[: len(base) // bs * bs]
        computed, _ = self.kv.get_computed_blocks(prefix + [-1])
        num_revived = sum(self.kv.pool.ref_count(b) == 0 for b in computed)
        num_new = self.kv.num_free_blocks - num_revived + over
        if num_new <= 0:
            return
        tail = [1000 + self.next_id] * (num_new * bs)  # a token no other prompt uses: no extra hits
        rid = self._admit(prefix[: len(computed) * bs] + tail)
        assert (rid is None) == over

    @rule()
    def evict_everything(self):
        # A fresh prompt that takes every free block: all cached free blocks lose their hashes.
        n = self.kv.num_free_blocks
        if n == 0:
            return
        tokens = [100 + self.next_id] * (n * self.BLOCK_SIZE)
        assert self._admit(tokens) is not None
        assert self.kv.num_free_blocks == 0
        assert all(
            self.kv.pool.ref_count(b) > 0
            for b in range(self.NUM_BLOCKS)
            if self.kv.pool.block_hash(b) is not None
        )

    @precondition(lambda self: any(r.num_computed < len(r.tokens) for r in self.reqs.values()))
    @rule(data=st.data())
    def compute(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.reqs.items() if q.num_computed < len(q.tokens))))
        req = self.reqs[rid]
        req.num_computed = data.draw(st.integers(req.num_computed + 1, len(req.tokens)))
        self.kv.cache_blocks(rid, req.tokens, req.num_computed)
        bs = self.BLOCK_SIZE
        for i in range(req.num_computed // bs):
            self.content[req.table[i]] = tuple(req.tokens[: (i + 1) * bs])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        before = self._snapshot()
        table = self.kv.allocate_slots(rid, len(req.tokens) + len(extra))
        if table is None:
            assert self._snapshot() == before
            return
        assert table[: len(req.table)] == req.table
        req.tokens += extra
        req.table = table
        self.history.append(list(req.tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        free_before = self.kv.num_free_blocks
        released = [b for b in req.table if self.kv.pool.ref_count(b) == 1]
        self.kv.free(rid)
        assert self.kv.num_free_blocks == free_before + len(released)

    @rule()
    def free_unknown(self):
        before = self._snapshot()
        self.kv.free("unknown")
        assert self._snapshot() == before

    @rule()
    def reset_prefix_cache(self):
        idle = all(not r.table for r in self.reqs.values())
        assert self.kv.reset_prefix_cache() is idle

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        holders = [0] * self.NUM_BLOCKS
        for rid, req in self.reqs.items():
            assert self.kv.block_table(rid) == req.table
            for b in req.table:
                holders[b] += 1
        assert [self.kv.pool.ref_count(b) for b in range(self.NUM_BLOCKS)] == holders
        assert self.kv.num_free_blocks + sum(h > 0 for h in holders) == self.kv.num_total_blocks
        assert self.kv.num_requests == len(self.reqs)
        assert 0.0 <= self.kv.prefix_cache_hit_rate <= 1.0

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.reqs):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_requests == 0
        assert self.kv.num_free_blocks == self.kv.num_total_blocks


class ManagerMachineNoCaching(ManagerMachine):
    CACHING = False


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = MACHINE_SETTINGS
TestManagerMachineNoCaching = ManagerMachineNoCaching.TestCase
TestManagerMachineNoCaching.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
