"""transfer/: KV pushes between real NIXL agents in separate processes.

The tests drive workers from bench/harness/transfer_peers.py (spawned, one agent each,
Pipe commands, every wait bounded). Sender pools hold `block_pattern(block_id, salt)` in
every block, receiver pools start at zero, so a receiver pool can be checked byte for
byte: a pushed block must hold its source block's pattern, every other block zeros.
What they prove: a scattered, chunked push lands byte for byte and COMPLETE means all
of it is in; an incompatible or stale peer is refused, naming why; a restarted peer
replaces its old incarnation and never the other way round; an abort stops the posting
and both sides see it; a killed peer ends the other side's transfer within its bound;
interleaved requests to several receivers each end once. The formats the agents
exchange are tested in test_wire_formats.py, the pusher and receiver against a fake
NIXL in test_push_receive.py.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import replace

import pytest

from bench.harness.transfer_peers import BLOCK_BYTES, ChildError, PeerProcess, Recorded, block_pattern
from tests.transfer.test_wire_formats import named_fields
from transfer.handshake import TransferInfo
from transfer.push import PushStatus
from transfer.receive import ReceiveEvent, ReceiveStatus

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
        assert named_fields(refused.value.message) == {field}, refused.value.message
    with pytest.raises(ChildError) as refused:
        sender.call("add_peer", replace(info, agent_name="decode-7-2", model="m2",
                                        layout=replace(info.layout, block_size=8)).to_bytes())
    assert named_fields(refused.value.message) == {"model", "block_size"}
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
