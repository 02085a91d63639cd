"""BlockPool: LRU free queue, refcounts, prefix-cache hashes; plus a stateful model check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.block_hash import block_hashes, hash_block_tokens
from engine.block_pool import BlockPool

REPO = Path(__file__).resolve().parents[2]


def test_allocate_pops_lru_head_and_free_appends_in_order():
    pool = BlockPool(4, 2)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.free([3])
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [2, 0, 3]  # freed order is reuse order
    pool.check_invariants()


def test_allocate_none_when_short_changes_nothing():
    pool = BlockPool(3, 2)
    a = pool.allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    pool.free(a)
    assert pool.allocate(3) == [2, 0, 1]
    pool.check_invariants()


def test_freed_cached_block_is_a_hit_until_reused():
    pool = BlockPool(2, 2)
    [b] = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.lookup(h) == b  # still findable while free
    pool.touch([b])  # hit revives it: leaves the free queue
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.free([b])
    # Block 1 was never used, so it heads the queue; b goes second and loses its hash then.
    assert pool.allocate(1) == [1]
    assert pool.lookup(h) == b
    assert pool.allocate(1) == [b]
    assert pool.lookup(h) is None and pool.block_hash(b) is None
    pool.check_invariants()


def test_cache_block_keeps_existing_mapping():
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [5, 5])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.lookup(h) == a and pool.block_hash(b) is None
    pool.cache_block(a, h)  # idempotent
    with pytest.raises(ValueError):
        pool.cache_block(a, hash_block_tokens(None, [6, 6]))
    pool.check_invariants()


def test_touch_shares_and_free_needs_every_holder():
    pool = BlockPool(2, 2)
    [a] = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.free([a, a])  # one holder left: refused as a whole
    assert pool.ref_count(a) == 1
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_prefix_caching_disabled_never_hits():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    [a] = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    assert pool.lookup(h) is None and pool.block_hash(a) is None
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, 2)
    [a] = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h) == a
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h) is None
    pool.check_invariants()


def test_block_hashes_chain_full_blocks_only():
    hashes = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [1, 2])
    assert hashes[1] == hash_block_tokens(hashes[0], [3, 4])
    # Same block content under a different parent hashes differently.
    assert block_hashes([9, 9, 3, 4], 2)[1] != hashes[1]
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert len(hashes[0]) == 16
    assert block_hashes([1], 2) == []


# Pinned so a format change (which would break routing against older engines) is deliberate.
GOLDEN = "hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [2**40, -1, 0]).hex()"


def test_hash_is_stable_across_processes():
    here = eval(GOLDEN, {"hash_block_tokens": hash_block_tokens})
    code = f"from common.block_hash import hash_block_tokens; print({GOLDEN})"
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert outs == {here}
    assert here == "3044a64afe2ebb7bf302dcfc6e8ef267"


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / cache / hit / free against a model of holders per block."""

    NUM_BLOCKS = 8

    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.pool = BlockPool(self.NUM_BLOCKS, 2, enable_prefix_caching=caching)
        self.owners: list[list[int]] = []  # each owner holds one reference to each listed block
        self.hash_universe = [hash_block_tokens(None, [i, i]) for i in range(6)]

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free_before = self.pool.num_free_blocks
        blocks = self.pool.allocate(n)
        if n > free_before:
            assert blocks is None and self.pool.num_free_blocks == free_before
            return
        assert blocks is not None and len(set(blocks)) == n
        assert all(self.pool.block_hash(b) is None for b in blocks)  # reuse drops the hash
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data):
        owner = data.draw(st.sampled_from(self.owners))
        blocks = data.draw(st.lists(st.sampled_from(owner), unique=True)) if owner else []
        self.pool.touch(blocks)
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache(self, data):
        owner = data.draw(st.sampled_from(self.owners))
        if not owner:
            return
        block = data.draw(st.sampled_from(owner))
        h = data.draw(st.sampled_from(self.hash_universe))
        if self.pool.block_hash(block) not in (None, h):
            return  # a held block's hash never changes
        mapped = self.pool.lookup(h)
        self.pool.cache_block(block, h)
        if self.pool.enable_prefix_caching:
            assert self.pool.lookup(h) == (block if mapped is None else mapped)

    @rule(data=st.data())
    def hit(self, data):
        h = data.draw(st.sampled_from(self.hash_universe))
        block = self.pool.lookup(h)
        if block is None:
            return
        was_free = self.pool.ref_count(block) == 0
        free_before = self.pool.num_free_blocks
        self.pool.touch([block])
        assert self.pool.num_free_blocks == free_before - was_free
        self.owners.append([block])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data):
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.free(owner)

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        held = [0] * self.NUM_BLOCKS
        for owner in self.owners:
            for b in owner:
                held[b] += 1
        assert [self.pool.ref_count(b) for b in range(self.NUM_BLOCKS)] == held
        assert self.pool.num_free_blocks + sum(h > 0 for h in held) == self.pool.num_total_blocks

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for owner in self.owners:
            self.pool.free(owner)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self.pool.num_total_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
