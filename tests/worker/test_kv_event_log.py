"""A worker's numbered prefix-cache events as the gateways' Stats read them: each reader at
its own cursor, the net change after it, and a resync (the whole set, in pages) when its
cursor is too old or the engine's buffer dropped events."""

from __future__ import annotations

import random

from engine.kv_events import KVEventBatch
from gateway.routing.prefix_index import PrefixIndex
from rpc import pdserve_pb2 as pb
from rpc.convert import kv_events_from_pb, kv_events_to_pb
from worker.kv_event_log import RESYNC_PAGE, KVEventLog


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
    assert log.since(after.last) == (after.last, False, [], [], False, b"")
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


def _stats(log: KVEventLog, index: PrefixIndex) -> pb.StatsResponse:
    """One Stats round trip, as the gateway asks (readiness.py) and the worker answers (service.py)."""
    cursor = index.cursor("w:1")
    request = pb.StatsRequest(kv_events=True) if cursor is None else pb.StatsRequest(
        kv_events=True, kv_events_of=cursor[0], kv_events_after=cursor[1], kv_events_resync_after=cursor[2])
    after = request.kv_events_after if request.kv_events_of == "decode-0-1" else None
    answer = pb.StatsResponse(worker="decode-0-1")
    answer.kv_events.CopyFrom(kv_events_to_pb(log.since(after, request.kv_events_resync_after)))
    answer = pb.StatsResponse.FromString(answer.SerializeToString())  # what crosses the wire
    index.apply("w:1", answer.worker, kv_events_from_pb(answer.kv_events))
    return answer


def test_a_resync_comes_in_pages_and_events_between_them_are_not_lost():
    """The reader ends with the log's set exactly, whatever was stored or removed between
    its pages, on either side of the page boundary."""
    rng = random.Random(3)
    log, index = KVEventLog(capacity=64, page=8), PrefixIndex()
    held = {rng.randbytes(16) for _ in range(30)}
    log.take(KVEventBatch([], lost=True), lambda: list(held))
    pages = 0
    while True:
        answer = _stats(log, index)
        pages += 1
        assert len(answer.kv_events.stored) <= 8 + 4  # a page, and the events of a round
        churn = [(False, h) for h in rng.sample(sorted(held), 2)] + [(True, rng.randbytes(16)) for _ in range(2)]
        for stored, h in churn:
            (held.add if stored else held.discard)(h)
        log.take(_batch(*churn), lambda: [])
        if not answer.kv_events.more:
            break
    _stats(log, index)  # the events of the last round
    assert pages >= 4
    assert {h for h in held if index.longest_prefix(["w:1"], [h]) == {"w:1": 1}} == held
    assert index.entries == len(held)


def test_a_worker_caching_many_blocks_answers_stats_under_grpcs_default_bound():
    """300k blocks' hashes in one resync (~5.4 MiB) would fail every Stats (gRPC takes 4 MiB
    by default): paged, each answer stays far under it, and the reader gets the whole set."""
    held = [i.to_bytes(16, "big") for i in range(300_000)]
    log, index = KVEventLog(), PrefixIndex()
    log.take(KVEventBatch([], lost=True), lambda: held)
    sizes = []
    while True:
        answer = _stats(log, index)
        sizes.append(answer.ByteSize())
        if not answer.kv_events.more:
            break
    assert max(sizes) < 2 << 20 and len(sizes) == -(-len(held) // RESYNC_PAGE), (max(sizes), len(sizes))
    assert index.entries == len(held)
