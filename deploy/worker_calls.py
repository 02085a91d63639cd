"""The controller's gRPC to its workers: one channel per worker address, and the calls the
controller makes on them. Both roles answer the Worker service (deep `Health`, `Drain`,
`ChangeRole`: deploy/role_change.py); `SetPeers` is each role's own.

What each answer leads to is decided elsewhere: a failed deep check by the health rounds
(deploy/health_rounds.py), a Drain's holdings by the drain (deploy/drain.py), the peers
sent by the membership (deploy/membership.py). A channel is dropped when its worker's
address is replaced or removed (deploy/placement.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from deploy.drain import holdings_of
from deploy.slot import Slot
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.holdings import Holdings, loop_wait_s

log = logging.getLogger(__name__)


class WorkerCalls:
    """The channels by address; `event` reports what the user should see. Every call is
    bounded by `health_timeout_s` (a worker answers at once, or from its loop within a step
    for Drain), so a process that does not answer at all is the only one that waits it out."""

    def __init__(self, health_timeout_s: float, drain_hand_off: bool, event: Callable[[str], None]):
        self.health_timeout_s = health_timeout_s
        self.drain_hand_off = drain_hand_off  # a drained decode worker hands its requests off
        self.event = event
        self.channels: dict[str, grpc.Channel] = {}

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = auth.channel(address)
        return self.channels[address]

    def pop(self, address: str) -> grpc.Channel | None:
        """Forget the channel to `address` (the caller closes it, or leaves it to its calls)."""
        return self.channels.pop(address, None)

    def stub(self, slot: Slot) -> pb_grpc.WorkerStub:
        """Health, Drain and ChangeRole: the Worker service, which both roles answer."""
        return pb_grpc.WorkerStub(self.channel(slot.address))

    def healthy(self, slot: Slot) -> bool:
        """The deep health check: whether the worker's engine loop is making progress."""
        try:
            h = self.stub(slot).Health(pb.HealthRequest(deep=True), timeout=self.health_timeout_s)
        except grpc.RpcError as e:
            self.event(f"{slot.role} worker {slot.worker_id}: deep health got no answer "
                       f"({e.code().name}, {self.health_timeout_s:g}s deadline)")
            return False
        slot.stall_bound_s = h.stall_bound_s
        if h.straggler != slot.straggler:  # named once as it appears, once as it clears
            self.event(f"{slot.role} worker {slot.worker_id}: " + (f"a slow tensor-parallel rank: {h.straggler}"
                       if h.straggler else "no tensor-parallel rank holds the group back any more"))
            slot.straggler = h.straggler
        if not h.ok:
            self.event(f"{slot.role} worker {slot.worker_id}: deep health: {h.detail} "
                       f"[last step {h.last_step_age_s:.1f}s ago, queued {h.queued}, "
                       f"longest step {h.longest_step_s:.2f}s, stall bound {h.stall_bound_s:.1f}s]")
        return h.ok

    def ask_drain(self, slot: Slot) -> Holdings | None:
        """The Drain RPC: what the worker holds (it takes nothing new from the first call on;
        a decode worker hands its requests off, with `drain_hand_off`); None when it did not
        answer. The worker answers from its loop, within one step."""
        try:
            hand_off = slot.role == "decode" and self.drain_hand_off
            answer = self.stub(slot).Drain(pb.DrainRequest(hand_off=hand_off),
                                           timeout=loop_wait_s(slot.stall_bound_s) + self.health_timeout_s)
        except grpc.RpcError as e:
            log.info("%s worker %s: Drain got no answer (%s)", slot.role, slot.worker_id, e.code().name)
            return None
        slot.stall_bound_s = answer.stall_bound_s
        return holdings_of(answer)

    def set_peers(self, slot: Slot, decode_agents: list[str], workers: list[str]) -> bool:
        """A prefill worker gets the decode agents (and the worker addresses, which it fetches
        prefixes from), a decode worker the worker addresses; False when the call failed (the
        next round sends it again; its health check judges it)."""
        stub = pb_grpc.PrefillWorkerStub if slot.role == "prefill" else pb_grpc.DecodeWorkerStub
        request = pb.SetPeersRequest(decode_agents=decode_agents, workers=workers) if slot.role == "prefill" else \
            pb.SetPeersRequest(workers=workers)
        try:
            stub(self.channel(slot.address)).SetPeers(request, timeout=self.health_timeout_s)
            return True
        except grpc.RpcError as e:
            log.info("%s worker %s: SetPeers failed: %s", slot.role, slot.worker_id, e.code().name)
            return False
