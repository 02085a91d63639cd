"""transfer/: KV pushes between real NIXL agents in separate processes, plus unit tests.

The process tests drive workers from bench/harness/transfer_peers.py (spawned, one agent each,
Pipe commands, every wait bounded). Sender pools hold `block_pattern(block_id, salt)` in
every block, receiver pools start at zero, so a receiver pool can be checked byte for
byte: a pushed block must hold its source block's pattern, every other block zeros.
The unit tests at the end need no NIXL: the pusher and receiver run against a fake
nixl_agent whose writes stay in flight until the test completes them.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from bench.harness.transfer_peers import BLOCK_BYTES, MODEL, ChildError, PeerProcess, Recorded, block_pattern
from tests.transfer.fake_nixl import fake_agent
from transfer.agent import UnknownPeerError
from transfer.handshake import HandshakeError, TransferInfo, agent_name, check_compatible, parse_agent_name
from transfer.layout import KVLayout, compatibility_hash, region_indices, region_table
from transfer.messages import Notification, NotifKind, decode, encode
from transfer.push import KVPusher, PushStatus
from transfer.receive import KVReceiver, ReceiveEvent, ReceiveStatus

SENDER_BLOCKS = 64
RECEIVER_BLOCKS = 96  # pool sizes may differ between peers; the compatibility hash ignores them
SENDER = "prefill-0-1"
RECEIVER = "decode-0-1"
SALT = 1
ZERO_BLOCK = bytes(BLOCK_BYTES)
BYTES_METRIC = "pdserve_kv_transfer_bytes_total"

Chunks = list[tuple[list[int], list[int]]]  # (local blocks, remote blocks) per chunk


# ---------------------------------------------------------------- helpers for the process tests

def source_bytes(local_blocks: list[int], salt: int = SALT) -> bytes:
    return b"".join(block_pattern(b, salt) for b in local_blocks)


def assert_pool(pool: bytes, written: dict[int, bytes]) -> None:
    """`pool` holds written[b] in every written block b and zeros everywhere else."""
    blocks = [pool[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES] for b in range(len(pool) // BLOCK_BYTES)]
    wrong = [b for b, data in enumerate(blocks) if data != written.get(b, ZERO_BLOCK)]
    assert not wrong, f"blocks with unexpected bytes: {wrong} (written: {sorted(written)})"


def push_ops(request_id: str, peer: str, chunks: Chunks) -> list[tuple]:
    ops = [("start", request_id, peer)]
    ops += [("push", request_id, local, remote, i == len(chunks) - 1) for i, (local, remote) in enumerate(chunks)]
    return ops


def push_and_check(sender: PeerProcess, receiver: PeerProcess, request_id: str, chunks: Chunks,
                   written: dict[int, bytes]) -> tuple[Recorded, Recorded]:
    """Push `chunks`, check both events and the receiver's whole pool; `written` is updated."""
    local = [b for c in chunks for b in c[0]]
    remote = [b for c in chunks for b in c[1]]
    receiver.call("expect", request_id, remote, sender.name, 10.0)
    sender.call("ops", push_ops(request_id, receiver.name, chunks))
    [done] = sender.wait_events(lambda e: len(e) >= 1)
    assert done.event.status is PushStatus.DONE, done
    assert (done.event.request_id, done.event.peer) == (request_id, receiver.name)
    assert done.event.num_bytes == len(local) * BLOCK_BYTES
    [complete] = receiver.wait_events(lambda e: len(e) >= 1)
    assert complete.event == ReceiveEvent(request_id, ReceiveStatus.COMPLETE, sender.name, len(local))
    # Copied in the loop iteration that received the notification: all data was in by then.
    assert complete.data == source_bytes(local, sender.salt)
    written.update({r: block_pattern(b, sender.salt) for b, r in zip(local, remote)})
    assert_pool(receiver.call("read"), written)
    return done, complete


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def handles_of_trace(trace: list[tuple]) -> dict[int, bytes]:
    """serial -> notification bytes of every transfer handle made in `trace`."""
    return {serial: notif for kind, serial, notif in trace if kind == "make"}


@pytest.fixture(scope="module")
def pair():
    """One sender and one receiver for the whole module; tests that kill or restart a worker
    start their own. The sender has done its handshake with the receiver."""
    sender = PeerProcess(SENDER, SENDER_BLOCKS, salt=SALT)
    receiver = PeerProcess(RECEIVER, RECEIVER_BLOCKS)
    try:
        sender.wait_ready()
        receiver.wait_ready()
        assert sender.call("add_peer", receiver.info_bytes) == RECEIVER
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def fresh(pair):
    """The shared pair with a zeroed receiver pool and no stale events; afterwards, the
    sender must have no push left open (leak check)."""
    sender, receiver = pair
    assert receiver.call("zero") == 0
    sender.call("events")
    receiver.call("events")
    yield sender, receiver
    assert sender.call("num_active") == 0


# ---------------------------------------------------------------- 1. scattered chunked push

def test_scattered_chunked_push_is_byte_exact_and_complete_means_complete(fresh):
    sender, receiver = fresh
    chunks = [([3, 17, 8], [50, 4, 77]), ([40], [12]), ([2, 63], [90, 33]), ([29, 11], [61, 7])]
    bytes_before = sender.call("metric", BYTES_METRIC, {"peer_role": "decode"}) or 0.0
    trace_start = len(sender.call("trace"))

    done, _ = push_and_check(sender, receiver, "scatter-1", chunks, written={})

    assert done.event.remote_blocks == () and done.event.reason == ""
    assert sender.call("events") == [] and receiver.call("events") == []  # exactly one event each
    # The last write (the one carrying the notification) was posted only after every earlier
    # write was seen DONE, in the real agent's call sequence.
    trace = sender.call("trace")[trace_start:]
    made = handles_of_trace(trace)
    assert list(made.values()) == [b"", b"", b"", b"pdkv/1 done scatter-1 8"]
    last = max(made)
    last_post = trace.index(("post", last, None))
    for serial in made:
        if serial != last:
            assert ("state", serial, "DONE") in trace[:last_post], f"write {serial} not done before the last post"
    # Metrics move in the sender's process.
    bytes_after = sender.call("metric", BYTES_METRIC, {"peer_role": "decode"})
    assert bytes_after - bytes_before == 8 * BLOCK_BYTES
    assert sender.call("metric", "pdserve_kv_transfers_in_flight", {}) == 0


# ---------------------------------------------------------------- 2. handshake refusals

def _named_fields(message: str) -> set[str]:
    """The field names listed in a check_compatible message: '... (f1: a here vs b, f2: ...); ...'."""
    diffs = re.search(r"\((.*)\); both sides", message).group(1)
    return {part.split(":")[0] for part in diffs.split(", ")}


def test_incompatible_peer_is_refused_naming_the_differing_field(fresh):
    sender, receiver = fresh
    info = TransferInfo.from_bytes(receiver.info_bytes)
    peers_before = sender.call("peers")
    variants = {  # what a worker started with other settings would publish
        "block_size": replace(info, agent_name="decode-7-1", layout=replace(info.layout, block_size=32)),
        "dtype": replace(info, agent_name="decode-8-1", layout=replace(info.layout, dtype="float16")),
        "model": replace(info, agent_name="decode-9-1", model="another-model"),
        "regions_per_block": replace(info, agent_name="decode-10-1", layout=replace(info.layout, regions_per_block=4)),
    }
    for field, bad in variants.items():
        with pytest.raises(ChildError) as refused:
            sender.call("add_peer", bad.to_bytes())
        assert refused.value.kind == "HandshakeError"
        assert _named_fields(refused.value.message) == {field}, refused.value.message
    with pytest.raises(ChildError) as refused:
        sender.call("add_peer", replace(info, agent_name="decode-7-2", model="m2",
                                        layout=replace(info.layout, block_size=8)).to_bytes())
    assert _named_fields(refused.value.message) == {"model", "block_size"}
    assert "block_size: 16 here vs 8" in refused.value.message
    # Another protocol version and a foreign blob are refused by from_bytes (in the child).
    other_protocol = json.loads(receiver.info_bytes)
    other_protocol["protocol_version"] = 2
    for blob, words in [(json.dumps(other_protocol).encode(), "protocol 2"),
                        (b'{"kind": "vllm-nixl-metadata", "engine_id": "x"}', "malformed")]:
        with pytest.raises(ChildError) as refused:
            sender.call("add_peer", blob)
        assert refused.value.kind == "HandshakeError" and words in refused.value.message
    assert sender.call("peers") == peers_before


# ---------------------------------------------------------------- 3. restarted peer

def test_restarted_peer_replaces_its_stale_incarnation(fresh):
    sender, _ = fresh
    old = PeerProcess("decode-5-1", RECEIVER_BLOCKS)
    new = None
    try:
        assert sender.call("add_peer", old.wait_ready()) == "decode-5-1"
        push_and_check(sender, old, "restart-a", [([4, 5], [6, 70]), ([9], [1])], written={})
        old.shutdown()  # the worker exits ...
        new = PeerProcess("decode-5-2", RECEIVER_BLOCKS)  # ... and comes back as a new incarnation
        assert sender.call("add_peer", new.wait_ready()) == "decode-5-2"
        peers = sender.call("peers")
        assert "decode-5-2" in peers and "decode-5-1" not in peers
        with pytest.raises(ChildError) as unknown:
            sender.call("ops", [("start", "restart-b", "decode-5-1")])
        assert unknown.value.kind == "UnknownPeerError" and "decode-5-1" in unknown.value.message
        push_and_check(sender, new, "restart-c", [([4, 30], [6, 71]), ([31], [95])], written={})
    finally:
        old.close()
        if new is not None:
            new.close()


# ---------------------------------------------------------------- 4. abort

def test_abort_stops_posting_and_both_sides_see_aborted(fresh):
    sender, receiver = fresh
    rid = "abort-1"
    receiver.call("expect", rid, [10, 11, 20, 30, 31], SENDER, 10.0)
    trace_start = len(sender.call("trace"))
    sender.call("ops", [("start", rid, RECEIVER), ("push", rid, [1, 2], [10, 11]), ("push", rid, [3], [20]),
                        ("abort", rid),
                        ("push", rid, [4], [30]), ("push", rid, [5], [31], True)])  # after the abort
    [aborted] = sender.wait_events(lambda e: len(e) >= 1)
    assert aborted.event.status is PushStatus.ABORTED and aborted.event.request_id == rid
    assert aborted.event.num_bytes == 3 * BLOCK_BYTES  # the two writes in flight at the abort completed
    [seen] = receiver.wait_events(lambda e: len(e) >= 1)
    assert seen.event == ReceiveEvent(rid, ReceiveStatus.ABORTED, SENDER, 0)
    # A chunk pushed after ABORTED was reported is ignored too.
    sender.call("ops", [("push", rid, [6], [32], True)])
    time.sleep(0.3)
    assert sender.call("events") == [] and receiver.call("events") == []
    assert list(handles_of_trace(sender.call("trace")[trace_start:]).values()) == [b"", b""]  # nothing after
    assert_pool(receiver.call("read"), {10: block_pattern(1, SALT), 11: block_pattern(2, SALT),
                                        20: block_pattern(3, SALT)})  # 30, 31 and 32 never written

    # Aborting before any chunk: ABORTED at once on both sides.
    receiver.call("expect", "abort-2", [40], SENDER, 10.0)
    sender.call("ops", [("start", "abort-2", RECEIVER), ("abort", "abort-2")])
    [aborted] = sender.wait_events(lambda e: len(e) >= 1)
    assert (aborted.event.status, aborted.event.num_bytes) == (PushStatus.ABORTED, 0)
    [seen] = receiver.wait_events(lambda e: len(e) >= 1)
    assert seen.event.status is ReceiveStatus.ABORTED


# ---------------------------------------------------------------- 5. killed peers

def test_killed_receiver_fails_the_push_within_seconds(fresh):
    sender, receiver = fresh
    victim = PeerProcess("decode-6-1", RECEIVER_BLOCKS)
    try:
        sender.call("add_peer", victim.wait_ready())
        push_and_check(sender, victim, "kill-warm", [([1], [2])], written={})  # connection is up
        victim.kill()
        for rid in ["kill-1", "kill-2"]:  # the first push after the death, and one more
            t0 = time.monotonic()
            sender.call("ops", push_ops(rid, "decode-6-1", [([1, 2], [10, 11]), ([3], [12])]))
            [failed] = sender.wait_events(lambda e: len(e) >= 1, timeout_s=5.0)
            assert failed.t - t0 < 5.0
            ev = failed.event
            assert (ev.request_id, ev.status, ev.peer) == (rid, PushStatus.FAILED, "decode-6-1")
            assert {10, 11} <= set(ev.remote_blocks) <= {10, 11, 12} and ev.reason, ev
            assert sender.call("num_active") == 0
        # The sender still serves its live peers.
        push_and_check(sender, receiver, "after-kill", [([7], [8])], written={})
    finally:
        victim.close()


def test_killed_sender_times_out_on_the_receiver_at_its_deadline(fresh):
    _, receiver = fresh
    doomed = PeerProcess("prefill-1-1", SENDER_BLOCKS, salt=2)
    try:
        doomed.wait_ready()
        doomed.call("add_peer", receiver.info_bytes)
        t0 = time.monotonic()
        receiver.call("expect", "orphan-1", [20, 21, 22], "prefill-1-1", 2.0)
        doomed.call("ops", [("start", "orphan-1", RECEIVER), ("push", "orphan-1", [5], [20])])
        wait_until(lambda: any(s == "DONE" for k, _, s in doomed.call("trace") if k == "state"), 5.0,
                   "first chunk written")
        doomed.kill()  # mid-request: the last chunk never comes
        [timed_out] = receiver.wait_events(lambda e: len(e) >= 1, timeout_s=8.0)
        assert timed_out.event == ReceiveEvent("orphan-1", ReceiveStatus.TIMED_OUT, "prefill-1-1", 0)
        assert 2.0 <= timed_out.t - t0 < 5.0  # at the deadline, not before and not long after
        assert_pool(receiver.call("read"), {20: block_pattern(5, 2)})
    finally:
        doomed.close()


# ---------------------------------------------------------------- 6. many transfers, several peers

def test_interleaved_requests_to_three_receivers_each_done_once(fresh):
    sender, receiver0 = fresh
    others = [PeerProcess("decode-1-1", RECEIVER_BLOCKS), PeerProcess("decode-2-1", RECEIVER_BLOCKS)]
    try:
        receivers = [receiver0]
        for r in others:
            sender.call("add_peer", r.wait_ready())
            receivers.append(r)
        rng = random.Random(20261130)
        free = {r.name: rng.sample(range(RECEIVER_BLOCKS), RECEIVER_BLOCKS) for r in receivers}
        plans: dict[str, tuple[PeerProcess, Chunks]] = {}
        for i in range(21):
            target = receivers[i % 3]
            chunks = []
            for _ in range(rng.randint(2, 3)):
                n = rng.randint(1, 3)
                chunks.append((rng.sample(range(SENDER_BLOCKS), n), [free[target.name].pop() for _ in range(n)]))
            plans[f"many-{i}"] = (target, chunks)
        for rid, (target, chunks) in plans.items():
            target.call("expect", rid, [b for c in chunks for b in c[1]], SENDER, 30.0)
        # Interleave every request's ops at random, keeping each request's own order.
        pending = {rid: push_ops(rid, target.name, chunks) for rid, (target, chunks) in plans.items()}
        ops = []
        while pending:
            rid = rng.choice(sorted(pending))
            ops.append(pending[rid].pop(0))
            if not pending[rid]:
                del pending[rid]
        for i in range(0, len(ops), 6):  # several calls, so the sender's loop polls in between
            sender.call("ops", ops[i:i + 6])

        sent = sender.wait_events(lambda e: len(e) >= len(plans), timeout_s=30.0)
        got = {r.name: r.wait_events(lambda e, r=r: len(e) >= sum(t is r for t, _ in plans.values()), 30.0)
               for r in receivers}
        time.sleep(0.2)
        sent += sender.call("events")
        for r in receivers:
            got[r.name] += r.call("events")

        assert Counter(rec.event.request_id for rec in sent) == Counter(list(plans))  # exactly one each
        for rec in sent:
            target, chunks = plans[rec.event.request_id]
            assert rec.event.status is PushStatus.DONE, rec
            assert rec.event.peer == target.name
            assert rec.event.num_bytes == sum(len(c[0]) for c in chunks) * BLOCK_BYTES
        for r in receivers:
            mine = {rid for rid, (t, _) in plans.items() if t is r}
            assert Counter(rec.event.request_id for rec in got[r.name]) == Counter(mine)
            written = {}
            for rec in got[r.name]:
                chunks = plans[rec.event.request_id][1]
                local = [b for c in chunks for b in c[0]]
                assert rec.event.status is ReceiveStatus.COMPLETE and rec.event.sender == SENDER
                assert rec.data == source_bytes(local)
                written.update({rb: block_pattern(lb, SALT) for c in chunks for lb, rb in zip(*c)})
            assert_pool(r.call("read"), written)
    finally:
        for r in others:
            r.close()


# ---------------------------------------------------------------- 7. unit tests without NIXL

LAYOUT = KVLayout(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def test_layout_sizes_for_each_granularity():
    assert LAYOUT.block_bytes == BLOCK_BYTES == 2 * 4 * 16 * 2 * 64 * 2
    assert LAYOUT.pool_bytes == 64 * BLOCK_BYTES
    for regions, region_bytes in [(1, BLOCK_BYTES), (4, BLOCK_BYTES // 4), (8, BLOCK_BYTES // 8)]:
        assert replace(LAYOUT, regions_per_block=regions).region_bytes == region_bytes
    assert replace(LAYOUT, dtype="float32").block_bytes == 2 * BLOCK_BYTES


@pytest.mark.parametrize("regions", [1, 4, 8])
def test_region_table_tiles_the_pool(regions):
    layout = replace(LAYOUT, num_blocks=5, regions_per_block=regions)
    base = 0x7F0000001000
    table = region_table(base, layout, device_id=3)  # [num_blocks * regions, 3]
    assert table.shape == (5 * regions, 3) and table.dtype == np.int64
    assert (table[:, 1] == BLOCK_BYTES // regions).all() and (table[:, 2] == 3).all()
    # Consecutive, gap-free, starting at the base: region j of block b is row b * regions + j.
    assert (table[:, 0] == base + np.arange(5 * regions) * (BLOCK_BYTES // regions)).all()
    assert table[2 * regions, 0] == base + 2 * BLOCK_BYTES
    assert table[-1, 0] + table[-1, 1] == base + layout.pool_bytes


def test_region_indices_pair_regions_of_blocks_in_order():
    assert region_indices([3, 9], 1).tolist() == [3, 9]
    assert region_indices([3, 9], 4).tolist() == [12, 13, 14, 15, 36, 37, 38, 39]
    assert region_indices([1], 8).tolist() == list(range(8, 16))
    assert region_indices([], 4).tolist() == []
    assert region_indices([63], 8).dtype == np.int32


def test_layout_refusals():
    with pytest.raises(ValueError, match="regions_per_block=3"):
        replace(LAYOUT, regions_per_block=3)
    with pytest.raises(ValueError, match="int8"):
        replace(LAYOUT, dtype="int8")


def test_compatibility_hash_ignores_pool_size_only():
    h = compatibility_hash(MODEL, LAYOUT)
    assert compatibility_hash(MODEL, replace(LAYOUT, num_blocks=1000)) == h
    for other in [replace(LAYOUT, block_size=32), replace(LAYOUT, dtype="float16"),
                  replace(LAYOUT, regions_per_block=4), replace(LAYOUT, num_kv_heads=3)]:
        assert compatibility_hash(MODEL, other) != h
    assert compatibility_hash("other", LAYOUT) != h


@settings(max_examples=200, deadline=None)
@given(role=st.text(st.characters(blacklist_characters="-", blacklist_categories=("Cs",)), min_size=1),
       worker_id=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1),
       incarnation=st.integers(0, 2**40))
def test_agent_name_round_trips(role, worker_id, incarnation):
    assert parse_agent_name(agent_name(role, worker_id, incarnation)) == (role, worker_id, incarnation)


def test_agent_name_refusals():
    for bad in ["decode", "decode-1", "-0-1", "decode-0-x", "decode--1", "decode-0-"]:
        with pytest.raises(HandshakeError):
            parse_agent_name(bad)
    for args in [("de-code", "0", 1), ("", "0", 1), ("decode", "", 1), ("decode", "0", -1)]:
        with pytest.raises(ValueError):
            agent_name(*args)


def _info(**changes) -> TransferInfo:
    info = TransferInfo("decode-0-1", bytes(range(256)) * 3, MODEL, LAYOUT, 0x7F00DEAD0000, 0)
    return replace(info, **changes)


def test_transfer_info_round_trip():
    info = _info()
    assert TransferInfo.from_bytes(info.to_bytes()) == info
    assert info.worker_key == ("decode", "0")


def _edited(edit) -> bytes:
    d = json.loads(_info().to_bytes())
    edit(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize("blob, words", [
    (_edited(lambda d: d.update(compat_hash="0" * 32)), "compatibility hash"),
    (_edited(lambda d: d["layout"].update(block_size=32)), "compatibility hash"),  # field edited, hash kept
    (_edited(lambda d: d.update(model="other")), "compatibility hash"),
    (_edited(lambda d: d.update(protocol_version=2)), "protocol 2"),
    (_edited(lambda d: d.pop("base_addr")), "malformed"),
    (_edited(lambda d: d["layout"].update(regions_per_block=3)), "malformed"),
    (_edited(lambda d: d["layout"].update(page_size=16)), "malformed"),
    (_edited(lambda d: d.update(agent_metadata="not base64!")), "malformed"),
    (_edited(lambda d: d.update(agent_name="nodashes")), "nodashes"),
    (_edited(lambda d: d.update(agent_name=5)), "malformed"),
    # num_blocks is outside the compatibility hash (pools differ in size), so only a bound stops
    # a claimed billion blocks from becoming a descriptor table of tens of GB
    (_edited(lambda d: d["layout"].update(num_blocks=10**9)), "num_blocks=1000000000: must be an integer in"),
    (_edited(lambda d: d["layout"].update(num_blocks=0)), "num_blocks=0"),
    (b"not json at all", "malformed"),
    (b"\xff\xfe\x00", "malformed"),
    (b"[1, 2, 3]", "malformed"),
    (b'{"kind": "vllm-nixl-metadata"}', "malformed"),
])
def test_transfer_info_from_bytes_refuses(blob, words):
    with pytest.raises(HandshakeError, match=re.escape(words)):
        TransferInfo.from_bytes(blob)


def test_check_compatible_names_every_differing_field():
    check_compatible(_info(agent_name="prefill-0-1"), _info(layout=replace(LAYOUT, num_blocks=7)))
    with pytest.raises(HandshakeError) as refused:
        check_compatible(_info(agent_name="prefill-0-1"),
                         _info(model="m2", layout=replace(LAYOUT, dtype="float32", head_dim=128)))
    assert _named_fields(str(refused.value)) == {"model", "dtype", "head_dim"}


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(NotifKind),
       request_id=st.text(st.characters(blacklist_characters=" ", blacklist_categories=("Cs",)), min_size=1),
       num_blocks=st.integers(0, 10**6))
def test_notification_round_trips(kind, request_id, num_blocks):
    assert decode("prefill-0-1", encode(kind, request_id, num_blocks)) == \
        Notification("prefill-0-1", kind, request_id, num_blocks)


def test_foreign_notifications_decode_to_none():
    for message in [b"", b"hello", b"pdkv/2 done r 1", b"pdkv/1 close r 1", b"pdkv/1 done r x",
                    b"pdkv/1 done r 1 extra", b"\xff\xfe", "pdkv/1 done".encode() + b"\x00"]:
        assert decode("x", message) is None
    for bad in ["", "has space"]:
        with pytest.raises(ValueError):
            encode(NotifKind.DONE, bad, 1)


# ---------------------------------------------------------------- pusher / receiver with a fake NIXL

def test_last_chunk_waits_until_every_earlier_write_is_done():
    agent = fake_agent(regions_per_block=4)
    nixl, pusher = agent.nixl, KVPusher(agent)
    pusher.start("r", "decode-0-1")
    pusher.push("r", [3, 9], [40, 2])
    pusher.push("r", [5], [7])
    pusher.push("r", [6], [8], last=True)
    c1, c2 = nixl.made
    assert c1.posted and c2.posted and c1.notif == c2.notif == b""
    assert (c1.local, c1.remote) == ([12, 13, 14, 15, 36, 37, 38, 39], [160, 161, 162, 163, 8, 9, 10, 11])
    c1.state = "DONE"
    assert pusher.poll() == [] and len(nixl.made) == 2  # c2 still in flight: the last one waits
    assert c1.released
    c2.state = "DONE"
    assert pusher.poll() == []
    [c3] = nixl.made[2:]
    assert c3.posted and c3.notif == b"pdkv/1 done r 4"
    assert pusher.poll() == []  # posted is not done
    c3.state = "DONE"
    [done] = pusher.poll()
    assert (done.request_id, done.status, done.num_bytes) == ("r", PushStatus.DONE, 4 * BLOCK_BYTES)
    assert c3.released and pusher.num_active == 0 and nixl.notifs == []


def test_abort_waits_for_writes_in_flight_then_notifies_once():
    agent = fake_agent()
    nixl, pusher = agent.nixl, KVPusher(agent)
    pusher.start("r", "decode-0-1")
    pusher.push("r", [1], [10])
    pusher.push("r", [2], [11])
    pusher.push("r", [3], [12], last=True)  # queued behind the two in flight
    pusher.abort("r")
    pusher.push("r", [4], [13])  # after the abort: dropped
    assert pusher.poll() == [] and nixl.notifs == []
    nixl.made[0].state = "DONE"
    assert pusher.poll() == [] and nixl.notifs == []  # one write still in flight
    nixl.made[1].state = "DONE"
    [aborted] = pusher.poll()
    assert (aborted.status, aborted.num_bytes) == (PushStatus.ABORTED, 2 * BLOCK_BYTES)
    assert len(nixl.made) == 2  # the queued last chunk was never posted
    assert nixl.notifs == [("decode-0-1", b"pdkv/1 abort r 0")]
    assert pusher.poll() == [] and pusher.num_active == 0


def test_write_error_fails_with_every_unconfirmed_block():
    agent = fake_agent()
    nixl, pusher = agent.nixl, KVPusher(agent)
    failures = REGISTRY.get_sample_value("pdserve_kv_transfer_failures_total", {"reason": "transfer_error"}) or 0
    pusher.start("r", "decode-0-1")
    pusher.push("r", [1], [10])
    pusher.push("r", [2, 3], [11, 12])
    pusher.push("r", [4], [13], last=True)
    nixl.made[0].state = "DONE"
    nixl.made[1].state = "ERR"
    [failed] = pusher.poll()
    assert (failed.status, failed.reason) == (PushStatus.FAILED, "transfer error")
    assert failed.remote_blocks == (11, 12, 13) and failed.num_bytes == BLOCK_BYTES
    assert all(h.released for h in nixl.made)
    assert REGISTRY.get_sample_value("pdserve_kv_transfer_failures_total", {"reason": "transfer_error"}) == failures + 1


def test_failed_post_fails_the_push_and_releases_its_handle():
    agent = fake_agent()
    nixl, pusher = agent.nixl, KVPusher(agent)
    nixl.post_error = RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    pusher.start("r", "decode-0-1")
    pusher.push("r", [1, 2], [10, 11])
    pusher.push("r", [3], [12], last=True)  # the push already failed: nothing more is posted
    [failed] = pusher.poll()
    assert failed.status is PushStatus.FAILED and "NIXL_ERR_REMOTE_DISCONNECT" in failed.reason
    assert failed.remote_blocks == (10, 11)
    assert len(nixl.made) == 1 and nixl.made[0].released


def test_a_failed_push_is_reported_only_once_none_of_its_writes_can_still_land():
    """A push that fails (here its timeout) while NIXL cannot cancel its writes in progress:
    FAILED (after which the decode worker reuses the blocks) comes only once every write
    of it has ended, never while one may still land in blocks given to another request."""
    agent = fake_agent()
    nixl, pusher = agent.nixl, KVPusher(agent)
    pusher.start("r", "decode-0-1", timeout_s=0.01)
    pusher.push("r", [1], [10])
    pusher.push("r", [2], [11])
    for write in nixl.made:
        write.cancellable = False
    time.sleep(0.05)
    assert pusher.poll() == [] and pusher.num_active == 1  # timed out, but its writes run on
    pusher.push("r", [3], [12], last=True)  # a failing push posts nothing more
    assert len(nixl.made) == 2
    nixl.made[0].state = "DONE"
    assert pusher.poll() == []
    nixl.made[1].state = "ERR"
    [failed] = pusher.poll()
    assert (failed.status, failed.reason) == (PushStatus.FAILED, "timeout")
    assert set(failed.remote_blocks) >= {11} and all(w.released for w in nixl.made)


def test_push_timeout_and_call_errors():
    agent = fake_agent()
    pusher = KVPusher(agent)
    with pytest.raises(UnknownPeerError, match="decode-9-9"):
        pusher.start("r", "decode-9-9")
    pusher.start("slow", "decode-0-1", timeout_s=0.01)
    pusher.push("slow", [1], [10])
    with pytest.raises(ValueError, match="already open"):
        pusher.start("slow", "decode-0-1")
    with pytest.raises(ValueError, match="local vs"):
        pusher.push("slow", [1, 2], [10])
    time.sleep(0.05)
    [failed] = pusher.poll()
    assert (failed.status, failed.reason, failed.remote_blocks) == (PushStatus.FAILED, "timeout", (10,))
    pusher.start("r", "decode-0-1")
    pusher.push("r", [], [], last=True)  # nothing to write: the notification alone
    assert pusher.poll()[0].status is PushStatus.DONE
    assert agent.nixl.notifs == [("decode-0-1", b"pdkv/1 done r 0")]
    pusher.push("r", [1], [1])  # a finished request: ignored
    assert pusher.num_active == 0


def test_metrics_count_bytes_of_a_push():
    agent = fake_agent()
    pusher = KVPusher(agent)
    labels = {"peer_role": "decode"}
    before = REGISTRY.get_sample_value(BYTES_METRIC, labels) or 0.0
    in_flight = REGISTRY.get_sample_value("pdserve_kv_transfers_in_flight", {})
    pusher.start("r", "decode-0-1")
    assert REGISTRY.get_sample_value("pdserve_kv_transfers_in_flight", {}) == in_flight + 1
    pusher.push("r", [1, 2, 3], [4, 5, 6], last=True)
    agent.nixl.made[0].state = "DONE"
    pusher.poll()
    assert REGISTRY.get_sample_value(BYTES_METRIC, labels) == before + 3 * BLOCK_BYTES
    assert REGISTRY.get_sample_value("pdserve_kv_transfers_in_flight", {}) == in_flight


def test_receiver_matches_notifications_to_expectations():
    agent = fake_agent()
    agent.nixl.incoming = {"prefill-0-1": [b"pdkv/1 done early 3", b"not ours"],
                           b"prefill-1-1": [b"pdkv/1 done wrong 1"]}
    receiver = KVReceiver(agent)
    assert receiver.poll() == []  # nothing expected yet: kept
    receiver.expect("early", "prefill-0-1")
    receiver.expect("wrong", "prefill-0-1")  # its notification came from another sender
    receiver.expect("gone", timeout_s=0.01)
    time.sleep(0.05)
    events = receiver.poll()
    assert ReceiveEvent("early", ReceiveStatus.COMPLETE, "prefill-0-1", 3) in events
    assert ReceiveEvent("gone", ReceiveStatus.TIMED_OUT, "", 0) in events
    assert len(events) == 2
    agent.nixl.incoming = {"prefill-1-1": [b"pdkv/1 abort a 0"]}
    receiver.expect("a")
    assert receiver.poll() == [ReceiveEvent("a", ReceiveStatus.ABORTED, "prefill-1-1", 0)]


def test_unexpected_notifications_are_bounded(monkeypatch):
    """Any agent that reaches this one can send notifications for ids nobody expects: they
    are kept (one may be early) but never more than the bound, the oldest dropped first."""
    import transfer.receive as receive

    monkeypatch.setattr(receive, "MAX_EARLY_NOTIFICATIONS", 100)
    agent = fake_agent()
    agent.nixl.incoming = {"prefill-9-1": [f"pdkv/1 done flood-{i} 1".encode() for i in range(1000)]}
    receiver = KVReceiver(agent)
    assert receiver.poll() == []
    assert len(receiver._early) == 100 and "flood-999" in receiver._early and "flood-0" not in receiver._early
    receiver.expect("flood-950", "prefill-9-1")
    assert receiver.poll() == [ReceiveEvent("flood-950", ReceiveStatus.COMPLETE, "prefill-9-1", 1)]


def test_agent_poll_notifications_skips_foreign_messages():
    agent = fake_agent()
    agent.nixl.incoming = {b"decode-0-1": [b"pdkv/1 abort r 0", b"hello", b"pdkv/9 done r 1"]}
    assert agent.poll_notifications() == [Notification("decode-0-1", NotifKind.ABORT, "r", 0)]


def test_late_info_of_an_older_incarnation_is_refused():
    """A restarted worker is never replaced by stale info from before its restart.

    Runs in a fresh interpreter: NIXL agents are never created in the pytest process."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from transfer import HandshakeError, KVLayout, TransferAgent
        layout = KVLayout(num_blocks=4, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
        pools = [torch.zeros(layout.pool_bytes // 2, dtype=torch.bfloat16) for _ in range(3)]
        me = TransferAgent("prefill-9-1", pools[0], layout, "m")
        new = TransferAgent("decode-9-7", pools[1], layout, "m")
        old = TransferAgent("decode-9-3", pools[2], layout, "m")
        assert me.add_peer(new.info()) == "decode-9-7"
        try:
            me.add_peer(old.info())
        except HandshakeError as e:
            assert "older" in str(e), e
        else:
            raise AssertionError("stale info accepted")
        assert list(me.peers) == ["decode-9-7"]
        for agent in (me, new, old):
            agent.close()
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]
