"""transfer/: the pusher and the receiver against a fake NIXL (tests/transfer/fake_nixl.py),
whose writes stay in flight until the test completes them. What they prove: the last
chunk's notification waits for every earlier write; an abort waits for the writes in
flight, then notifies once; a failed write or post fails the push with every block not
confirmed, reported once; timeouts and call errors end a push; the byte and in-flight
metrics count a push; the receiver matches notifications to what it expects, keeps
early ones within a bound, and skips foreign messages.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from bench.harness.transfer_peers import BLOCK_BYTES
from tests.transfer.fake_nixl import fake_agent
from transfer.agent import UnknownPeerError
from transfer.messages import Notification, NotifKind
from transfer.push import KVPusher, PushStatus
from transfer.receive import KVReceiver, ReceiveEvent, ReceiveStatus

BYTES_METRIC = "pdserve_kv_transfer_bytes_total"


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
