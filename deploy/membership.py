"""The deployment's workers as the controller keeps them, and the push of them to whoever
routes by them.

Each pool holds its workers' slots (deploy/slot.py: ready, or restarting under a new
incarnation); a worker placed by a scale and not ready yet is `starting`, in no pool; one
taken out of its pool to drain is `draining`, out of the routing but still finishing its
work. One lock guards them all, held only for a health round or a change of them, never
through a placement, a worker's loading or a drain.

`push` sends what the routing needs, in an order that keeps every route valid: the
workers' peers first (SetPeers: a prefill worker's KV destinations, a decode worker's
prefill workers), then the gateway's ready lists (deploy/gateway_link.py), with the
controller's metrics.
"""

from __future__ import annotations

import threading

from deploy import metrics
from deploy.gateway_link import GatewayLink
from deploy.planner.pools import Pools
from deploy.slot import Slot, SlotState
from deploy.worker_calls import WorkerCalls
from transfer.handshake import agent_name


class Membership:
    """The slots by pool and state; `incarnation` names the controller's metrics series."""

    def __init__(self, calls: WorkerCalls, gateway: GatewayLink, incarnation: str):
        self.calls = calls
        self.gateway = gateway
        self.incarnation = incarnation  # its metrics' series: new ones if the controller restarts
        self.pools: dict[str, list[Slot]] = {"prefill": [], "decode": []}
        self.draining: list[Slot] = []  # out of the pools and the routing, still finishing their work
        self.starting: list[Slot] = []  # placed by a scale, not ready yet: in no pool
        self.next_id = {"prefill": 0, "decode": 0}
        self.lock = threading.RLock()  # the pools and slots: held briefly, never through a placement or a drain
        self._peers_sent: dict[str, list[str]] = {}  # worker address -> the peers it was sent (SetPeers)

    def pooled(self) -> list[Slot]:
        """Every worker of both pools."""
        return [s for pool in self.pools.values() for s in pool]

    def new_worker_id(self, role: str) -> str:
        with self.lock:
            worker_id = str(self.next_id[role])
            self.next_id[role] += 1
        return worker_id

    def sizes(self) -> Pools:
        """The planner's view of the pools (deploy/planner_loop.py)."""
        with self.lock:
            return Pools(len(self.pools["prefill"]), len(self.pools["decode"]))

    def push(self) -> None:
        """The prefill workers first, then the gateway: a decode worker is routed to only once
        the prefill workers take its KV destinations."""
        self._push_peers()
        ready = {role: [s.address for s in slots if s.state is SlotState.READY] for role, slots in self.pools.items()}
        counts: dict[tuple[str, str], int] = {}
        for slot in self.pooled() + self.draining + self.starting:
            counts[slot.role, slot.state.value] = counts.get((slot.role, slot.state.value), 0) + 1
        metrics.set_pools(counts)
        self.gateway.push(ready["decode"], ready["prefill"], metrics.exposition(), self.incarnation)

    def _push_peers(self) -> None:
        """Every ready prefill worker learns the deployment's decode agents (the ready ones and
        those still draining): the only destinations its KV may go to. Every decode worker
        (ready or draining) learns the address of every worker not removed or replaced: the
        only ones it asks for prefills, and one that left is known gone (its blocks set aside
        for an unconfirmed abort are free again: decode/unconfirmed_aborts.py)."""
        slots = [*self.pools["prefill"], *self.pools["decode"], *self.draining]
        serving = [s for s in slots if s.state in (SlotState.READY, SlotState.DRAINING)]
        agents = [agent_name("decode", s.worker_id, s.incarnation) for s in serving if s.role == "decode"]
        workers = sorted(s.address for s in slots if s.address)
        for slot in serving:
            peers = agents if slot.role == "prefill" else workers
            if self._peers_sent.get(slot.address) == peers:
                continue  # it has this list (a restarted worker is a new address)
            if self.calls.set_peers(slot, agents, workers):
                self._peers_sent[slot.address] = peers
