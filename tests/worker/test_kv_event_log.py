"""A worker's numbered prefix-cache events as the gateways' Stats read them: each reader at
its own cursor, the net change after it, and a resync (the whole set) when its cursor is
too old or the engine's buffer dropped events."""

from __future__ import annotations

from engine.kv_events import KVEventBatch
from worker.kv_event_log import KVEventLog


def _batch(*events: tuple[bool, bytes]) -> KVEventBatch:
    return KVEventBatch(list(events), lost=False)


def test_readers_get_the_net_change_after_their_cursor():
    log = KVEventLog(capacity=10)
    log.take(KVEventBatch([], lost=True), lambda: [b"a"])  # what the pool held at start
    first = log.since(None)
    assert first.resync and first.stored == [b"a"]
    log.take(_batch((True, b"b"), (False, b"a"), (True, b"c"), (False, b"c")), lambda: [])
    after = log.since(first.last)
    assert not after.resync
    assert after.stored == [b"b"] and sorted(after.removed) == [b"a", b"c"]  # c: stored, then removed
    assert log.since(after.last) == (after.last, False, [], [])
    assert sorted(log.since(first.last + 1).removed) == [b"a", b"c"]  # another reader, further on
    assert len(log) == 1


def test_a_cursor_too_old_or_from_elsewhere_resyncs():
    log = KVEventLog(capacity=2)
    log.take(KVEventBatch([], lost=True), lambda: [])
    start = log.since(None).last
    log.take(_batch((True, b"a"), (True, b"b"), (True, b"c")), lambda: [])
    old = log.since(start)  # the first event fell out of the log
    assert old.resync and sorted(old.stored) == [b"a", b"b", b"c"]
    assert not log.since(old.last - 1).resync  # the kept ones still answer
    assert log.since(old.last + 5).resync  # a cursor this log never gave


def test_lost_events_replace_the_set_from_the_pool():
    log = KVEventLog()
    log.take(KVEventBatch([], lost=True), lambda: [])
    log.take(_batch((True, b"a")), lambda: [])
    cursor = log.since(None).last
    log.take(KVEventBatch([], lost=True), lambda: [b"z"])
    out = log.since(cursor)
    assert out.resync and out.stored == [b"z"]
