"""Where the controller's workers run: placing one on the cluster, waiting for it to serve,
taking on a new incarnation of it, and taking it off again.

Each worker gets a placement group of its own (a pool grows and shrinks one worker at a
time): one bundle per tensor-parallel rank, strictly packed on one node, and a host actor
in the first (deploy/hosts.py `WorkerHost`), which starts the worker's process and reports
on it; that process is rank 0 and starts the other ranks itself, on the node the group
reserved for them. A placed worker is `starting` (deploy/membership.py) until the
scale that placed it adds it to its pool (deploy/scaling.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.config import DeployConfig, PoolConfig
from deploy.hosts import WorkerHost
from deploy.membership import Membership
from deploy.slot import HostReport, Slot, SlotState
from deploy.worker_calls import WorkerCalls
from worker.holdings import shutdown_bound_s

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a bundle the cluster cannot place in this time is an error


class Placement:
    """Places and removes the workers of `membership`; their processes log under `log_dir`
    with `child_env` (the internal gRPC secret) added to their environment."""

    def __init__(self, config: DeployConfig, membership: Membership, calls: WorkerCalls, log_dir: str,
                 child_env: dict[str, str], event: Callable[[str], None]):
        self.config = config
        self.membership = membership
        self.calls = calls
        self.log_dir = log_dir
        self.child_env = child_env
        self.event = event

    def pool(self, role: str) -> PoolConfig:
        return self.config.prefill if role == "prefill" else self.config.decode

    def place(self, role: str) -> Slot:
        """A new `role` worker's placement group and host actor; its process starts loading.
        The slot is `starting` until it joins its pool."""
        pool = self.pool(role)
        worker_id = self.membership.new_worker_id(role)
        bundles = pool.bundles()  # one per tensor-parallel rank; the host actor (rank 0) takes the first
        pg = placement_group(bundles, strategy="STRICT_PACK", name=f"pdserve-{role}-{worker_id}")
        if not _wait(pg.ready(), PLACEMENT_TIMEOUT_S):
            remove_placement_group(pg)
            need = bundles[0] if len(bundles) == 1 else f"{len(bundles)} bundles {bundles}"
            raise RuntimeError(f"cannot place a {role} worker: no node has {need} free "
                               f"(waited {PLACEMENT_TIMEOUT_S:.0f}s)")
        options = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": dict(pool.resources),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}
        host = WorkerHost.options(**options).remote(role, worker_id, self.config.model, self.config.dtype,
                                                    pool.worker_args(), self.log_dir, self.child_env)
        self.event(f"{role} worker {worker_id}: placed, loading {self.config.model}")
        slot = Slot(role, worker_id, pg, host)
        with self.membership.lock:
            self.membership.starting.append(slot)
        return slot

    def wait_ready(self, slot: Slot) -> None:
        slot.address = ray.get(slot.host.ready.remote(self.config.ready_timeout_s),
                               timeout=self.config.ready_timeout_s + 30)
        slot.report = ray.get(slot.host.info.remote(), timeout=30)
        slot.incarnation, slot.node_id = slot.report.incarnation, slot.report.node_id
        slot.state = SlotState.READY
        self.event(f"{slot.role} worker {slot.worker_id}: ready on {slot.address}")

    def adopt(self, slot: Slot, report: HostReport) -> None:
        """The slot's worker is now the one `report` describes (a new incarnation, address)."""
        old = self.calls.pop(slot.address)
        if old is not None and report.address != slot.address:
            old.close()
        slot.report, slot.address, slot.incarnation = report, report.address, report.incarnation
        slot.node_id, slot.failures, slot.state = report.node_id, 0, SlotState.READY

    def process_alive(self, slot: Slot) -> bool:
        try:
            return ray.get(slot.host.info.remote(), timeout=10).alive
        except Exception:  # the host actor itself is gone
            return False

    def remove(self, slot: Slot) -> None:
        """Its host actor killed (its process with it), its placement group freed, its channel closed."""
        with self.membership.lock:
            if slot in self.membership.starting:
                self.membership.starting.remove(slot)
        quietly(lambda: ray.kill(slot.host, no_restart=True))
        quietly(lambda: remove_placement_group(slot.pg))
        channel = self.calls.pop(slot.address)
        if channel is not None:
            channel.close()


def stop_bound_s(slot: Slot) -> float:
    """How long the worker's host waits after SIGTERM before SIGKILL: the bound the worker's
    own shutdown is derived from (its stall bound, from its measured steps)."""
    return shutdown_bound_s(slot.stall_bound_s)


def quietly(fn: Callable[[], object]) -> None:
    """Run a clean-up of something that may be gone already."""
    try:
        fn()
    except Exception as e:  # clean-up of something already gone
        log.debug("ignored during clean-up: %s", e)


def _wait(ref, timeout_s: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)
