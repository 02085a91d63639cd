"""A pool's worker as the controller sees it: its state, what its host reports, its slot."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup


class SlotState(str, enum.Enum):
    """Where a worker is in its life (a str: `pdserve status --json` prints the value)."""

    STARTING = "starting"  # placed, loading; not routed to
    READY = "ready"  # in the membership
    RESTARTING = "restarting"  # its host actor or process is being replaced by Ray
    DRAINING = "draining"  # out of the membership, finishing its requests before it stops


@dataclass(frozen=True)
class HostReport:
    """What a worker's host actor says about its process (WorkerHost.info)."""

    address: str  # "" until the process printed that it serves
    alive: bool
    pid: int
    host_pid: int
    incarnation: int  # a restarted host starts a new one
    node_id: str
    log: str
    role: str = ""  # what the process serves: a restarted host starts it in the role it was placed with
    worker_id: str = ""
    exit_code: int | None = None  # once the process ended: its code (negative: the signal that killed it)


@dataclass
class Slot:
    """One worker of a pool: its placement group, host actor and what the last round saw."""

    role: str
    worker_id: str
    pg: PlacementGroup
    host: ray.actor.ActorHandle
    state: SlotState = SlotState.STARTING
    address: str = ""
    incarnation: int = 0
    node_id: str = ""
    failures: int = 0  # deep-health failures in a row
    restarts: int = 0
    stall_bound_s: float = 0.0  # its liveness bound, as its last Health or Drain answer said
    straggler: str = ""  # a tensor-parallel worker's rank holding its group back, as its last Health said
    report: HostReport | None = field(default=None, repr=False)

    def public(self) -> dict:
        r = self.report
        return {"role": self.role, "worker_id": self.worker_id, "state": self.state.value, "address": self.address,
                "incarnation": self.incarnation, "node_id": self.node_id, "restarts": self.restarts,
                "pid": r.pid if r else None, "host_pid": r.host_pid if r else None, "log": r.log if r else None,
                "straggler": self.straggler}
