"""The controller's health rounds: every `health_interval_s`, under the membership's lock,
each worker not draining is looked at, the gateway too, and the membership is pushed.

For each worker:

- its host actor's `info()` (a HostReport; states and reports: deploy/slot.py, the
  decisions they lead to: deploy/health.py): a host Ray is restarting, or whose worker
  process died, is out of the membership until its new incarnation is ready (a dead
  process is restarted by killing its host: Ray brings the actor back, which starts a fresh
  process); a new incarnation that starts in a role other than its pool's is changed back
  (deploy/role_change.py);
- a deep check over gRPC (deploy/worker_calls.py): `Health(deep=True)` says whether its
  engine loop is making progress (a busy worker by its last completed step against its
  own stall bound, an idle one by a probe through the loop: worker/liveness.py), so a
  slow, busy worker is kept and only a wedged one (or one that does not answer) fails;
  `unhealthy_after` failures in a row and the host is restarted, with the worker's own
  account logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import ray

from deploy import metrics
from deploy.config import DeployConfig
from deploy.gateway_link import GatewayLink
from deploy.health import Action, judge_health, judge_report
from deploy.membership import Membership
from deploy.placement import Placement, quietly
from deploy.role_change import RoleChangeFailed, change_role
from deploy.slot import HostReport, Slot, SlotState
from deploy.worker_calls import WorkerCalls
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)


class HealthRounds:
    """`run` is the health thread's target and returns once `stopping` is set."""

    def __init__(self, config: DeployConfig, membership: Membership, placement: Placement, calls: WorkerCalls,
                 gateway: GatewayLink, event: Callable[[str], None], stopping: threading.Event):
        self.config = config
        self.membership = membership
        self.placement = placement
        self.calls = calls
        self.gateway = gateway
        self.event = event
        self.stopping = stopping

    def run(self) -> None:
        while not self.stopping.wait(self.config.health_interval_s):
            try:
                with self.membership.lock:
                    self._round()
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health round failed")

    def _round(self) -> None:
        for slot in [s for s in self.membership.pooled() if s.state is not SlotState.DRAINING]:
            self._check(slot)
        self.gateway.check()
        self.membership.push()

    def _check(self, slot: Slot) -> None:
        try:
            report = ray.get(slot.host.info.remote(), timeout=10)
        except Exception:  # the actor died: Ray is restarting it
            report = None
        decision = judge_report(slot, report)
        if decision.action is Action.HOST_LOST:
            metrics.HEALTH_VERDICTS.labels(slot.role, "host_lost").inc()
            if slot.state is not SlotState.RESTARTING:
                self.event(f"{slot.role} worker {slot.worker_id}: host actor lost, Ray restarts it")
                slot.state = SlotState.RESTARTING
        elif decision.action is Action.WAIT:
            slot.state = SlotState.RESTARTING
            quietly(lambda: ray.get(slot.host.ready.remote(0.5), timeout=10))
        elif decision.action is Action.RESTORE_ROLE:
            self._restore_role(slot, report)
        elif decision.action is Action.ADOPT:
            self.placement.adopt(slot, report)
            slot.restarts += 1
            metrics.HEALTH_VERDICTS.labels(slot.role, "adopted").inc()
            self.event(f"{slot.role} worker {slot.worker_id}: incarnation {slot.incarnation} ready on "
                       f"{slot.address}")
        elif decision.action is Action.RESTART:
            self._restart(slot, decision.why)
        elif self.calls.healthy(slot):
            metrics.HEALTH_VERDICTS.labels(slot.role, "ok").inc()
            slot.failures = 0
        else:
            metrics.HEALTH_VERDICTS.labels(slot.role, "unhealthy").inc()
            slot.failures += 1
            decision = judge_health(slot.failures, self.config.unhealthy_after)
            if decision.action is Action.RESTART:
                self._restart(slot, decision.why)

    def _restore_role(self, slot: Slot, report: HostReport) -> None:
        """A host Ray restarted starts its process in the role it was placed with; a worker
        that has moved since is put back in its pool's role (a new incarnation of it)."""
        birth = report.role
        self.event(f"{slot.role} worker {slot.worker_id}: its restarted host started it as {birth} worker "
                   f"{report.worker_id}; changing it back to {slot.role}")
        slot.state, slot.address = SlotState.RESTARTING, report.address
        try:
            # a new incarnation: it holds nothing
            self.calls.stub(slot).Drain(pb.DrainRequest(), timeout=self.config.health_timeout_s)
            report = change_role(self.calls.stub(slot), slot.host, slot.role, slot.worker_id,
                                 self.placement.pool(slot.role).worker_args(),
                                 call_timeout_s=self.config.health_timeout_s,
                                 ready_timeout_s=self.config.ready_timeout_s)
        except (grpc.RpcError, RoleChangeFailed) as e:
            metrics.ROLE_CHANGES.labels(birth, slot.role, "failed").inc()
            self._restart(slot, f"could not put it back in its role ({str(e).splitlines()[0]})")
            return
        metrics.ROLE_CHANGES.labels(birth, slot.role, "restored").inc()
        self.placement.adopt(slot, report)
        slot.restarts += 1
        metrics.HEALTH_VERDICTS.labels(slot.role, "adopted").inc()
        self.event(f"{slot.role} worker {slot.worker_id}: incarnation {slot.incarnation} ready on {slot.address}")

    def _restart(self, slot: Slot, why: str) -> None:
        self.event(f"{slot.role} worker {slot.worker_id}: {why}; replacing it with a new incarnation")
        metrics.HEALTH_VERDICTS.labels(slot.role, "restart").inc()
        slot.state, slot.failures = SlotState.RESTARTING, 0
        self.calls.pop(slot.address)
        # Its process ends first (SIGKILL: it is wedged or silent), so that once the new
        # incarnation replaces its address, the decode workers may take it as gone.
        quietly(lambda: ray.get(slot.host.stop.remote(0.0), timeout=30))
        ray.kill(slot.host, no_restart=False)  # Ray restarts the actor, which starts a fresh process
