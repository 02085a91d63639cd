"""The block pool's prefix-cache events: in order, one per hash that became findable or
stopped being so, and a bounded buffer that says when it dropped some."""

from __future__ import annotations

from common.block_hash import block_hashes
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventBuffer


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    blocks, cached = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(rid, len(tokens), blocks) is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.free(rid)


def test_cached_then_evicted_hashes_come_out_in_order():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    events = kv.record_events()
    a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    _run(kv, "a", a)  # 3 blocks, 2 full: cached
    ha = block_hashes(a, 2)
    assert events.drain().events == [(True, ha[0]), (True, ha[1])]
    _run(kv, "a2", a)  # a hit: nothing new
    assert events.drain().events == []
    _run(kv, "b", b)  # 3 blocks from a pool of 4 with 2 cached: the oldest cached one is reused
    out = events.drain()
    hb = block_hashes(b, 2)
    assert not out.lost
    assert out.events[0] == (False, ha[1])  # freed tail first: evicted first
    assert [e for e in out.events if e[0]] == [(True, hb[0]), (True, hb[1])]
    assert sorted(kv.cached_hashes()) == sorted({ha[0], ha[1], *hb} - {h for stored, h in out.events
                                                                       if not stored})
    kv.check_invariants()


def test_a_full_buffer_and_a_reset_say_lost():
    buffer = KVEventBuffer(capacity=3)
    for i in range(3):
        buffer.stored(bytes([i]))
    buffer.removed(b"x")  # one too many: the reader must start over
    assert buffer.pending
    out = buffer.drain()
    assert out.lost and out.events == []
    assert not buffer.pending
    buffer.stored(b"y")
    assert buffer.drain().events == [(True, b"y")]

    kv = KVCacheManager(num_blocks=4, block_size=2)
    events = kv.record_events()
    _run(kv, "a", [1, 2, 3])
    assert kv.reset_prefix_cache()
    out = events.drain()
    assert out.lost and kv.cached_hashes() == []


def test_no_events_unless_asked():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    _run(kv, "a", [1, 2, 3])
    assert kv.pool.events is None
