"""Scaling the pools: the move from the pools' sizes now to the targets asked for (by
`pdserve scale` or the online planner: deploy/planner_loop.py), one move at a time.

New workers are placed (deploy/placement.py), all first so that they load in parallel, and
each joins its pool and the membership once ready. Leaving workers, the newest first, go
out of the membership at once and are then drained (deploy/drain.py) until each confirms it
holds nothing, is wedged, or `drain_timeout_s` passed, and only then stopped. When one pool
grows as the other shrinks and both reserve the same bundle, a drained worker of the one
changes its role in place to join the other, its weights kept, instead of a new worker
starting cold (deploy/role_change.py); a role change that fails becomes a cold start.

No placement, loading or drain holds the membership's lock: health rounds, replacements
and membership pushes go on meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from deploy import metrics
from deploy.config import DeployConfig
from deploy.drain import DrainEnd, Drained, drain
from deploy.membership import Membership
from deploy.placement import Placement, quietly, stop_bound_s
from deploy.role_change import Moves, RoleChangeFailed, change_role, in_place_moves
from deploy.slot import Slot, SlotState
from deploy.worker_calls import WorkerCalls
from worker.holdings import loop_wait_s

log = logging.getLogger(__name__)


class Scaling:
    """`scale` blocks until its move is done; `one_at_a_time` lets one run at a time (the
    CLI's and the planner's)."""

    def __init__(self, config: DeployConfig, membership: Membership, placement: Placement, calls: WorkerCalls,
                 event: Callable[[str], None]):
        self.config = config
        self.membership = membership
        self.placement = placement
        self.calls = calls
        self.event = event
        self.one_at_a_time = threading.Lock()

    def scale(self, prefill: int | None = None, decode: int | None = None) -> None:
        """To `prefill` and `decode` workers (None: that pool as it is)."""
        if decode is not None and decode < 1:
            raise ValueError("the decode pool needs at least one worker")
        if prefill is not None and prefill < 0:
            raise ValueError("the prefill pool cannot have fewer than 0 workers")
        targets = {"prefill": prefill, "decode": decode}
        for role, target in targets.items():
            if target is not None:
                metrics.POOL_TARGET.labels(role).set(target)
        t0 = time.monotonic()
        with self.one_at_a_time:  # one scale at a time; health rounds and replacements go on meanwhile
            with self.membership.lock:
                before = {role: len(slots) for role, slots in self.membership.pools.items()}
            moves = in_place_moves(before, targets, self.config)  # these change role instead of starting cold
            self._grow(targets, moves)
            with self.membership.lock:
                leaving = []
                for role, target in targets.items():
                    while target is not None and len(self.membership.pools[role]) > target:
                        leaving.append(self.membership.pools[role].pop())  # the newest first
                for slot in leaving:
                    slot.state = SlotState.DRAINING
                    self.membership.draining.append(slot)
                if leaving:
                    self.membership.push()  # out of routing now; the rounds go on while they drain
            ready_s = time.monotonic() - t0
            movers = [s for s in leaving if moves and s.role == moves.source][:moves.count if moves else 0]
            for slot in leaving:  # outside the lock: a slow drain holds up no health round
                drained = self._drain(slot)
                if slot in movers and drained.end is DrainEnd.EMPTY and self._change_role(slot, moves.target, drained):
                    continue
                self._retire(slot, drained)
                if slot in movers:  # its role did not change: the move is a cold start after all
                    self._add_cold(moves.target)
        self._log_scale(before, targets, ready_s, time.monotonic() - t0, moves)

    def _grow(self, targets: dict[str, int | None], moves: Moves | None) -> None:
        """Place the new workers (all first: they load in parallel) and add each to its pool
        once ready. Without the lock: placement and loading take minutes on a slow host, and
        health rounds, replacements and membership pushes must go on meanwhile."""
        new: list[Slot] = []
        try:
            for role, target in targets.items():
                moved_in = moves.count if moves and moves.target == role else 0
                for _ in range(0 if target is None else target - len(self.membership.pools[role]) - moved_in):
                    new.append(self.placement.place(role))
            for slot in new:
                self.placement.wait_ready(slot)
                self._join(slot)
        except Exception:
            for slot in new:
                if slot in self.membership.starting:  # not ready: in no pool
                    self.placement.remove(slot)
            raise

    def _join(self, slot: Slot) -> None:
        """A new worker, ready: into its pool and the membership."""
        with self.membership.lock:
            self.membership.starting.remove(slot)
            self.membership.pools[slot.role].append(slot)
            self.membership.push()

    def _log_scale(self, before: dict[str, int], targets: dict[str, int | None], ready_s: float, seconds: float,
                   moves: Moves | None) -> None:
        """The move, once done: its kind (a metric label) and how long it took, start to end."""
        grew = [r for r, t in targets.items() if t is not None and t > before[r]]
        shrank = [r for r, t in targets.items() if t is not None and t < before[r]]
        if not grew and not shrank:
            return
        kind = "move" if grew and shrank else "out" if grew else "in"
        metrics.SCALE_SECONDS.labels(kind).observe(seconds)
        sizes = ", ".join(f"{r} {before[r]} -> {t}" for r, t in targets.items() if t is not None and t != before[r])
        moved = f", {moves.count} moved in place ({moves.source} -> {moves.target})" if moves else ""
        self.event(f"scale ({kind}: {sizes}{moved}) done in {seconds:.1f}s: new workers ready after {ready_s:.1f}s, "
                   f"leaving ones drained (and moved or stopped) {seconds - ready_s:.1f}s later")

    def _drain(self, slot: Slot) -> Drained:
        """Out of the gateway's membership already; drained until it confirms it holds
        nothing (deploy/drain.py). A slow worker is given the time its requests take; only
        a wedged one, a dead one or the user's bound `drain_timeout_s` cuts the drain short."""
        who = f"{slot.role} worker {slot.worker_id}"
        self.event(f"{who}: draining")
        drained = drain(lambda: self.calls.ask_drain(slot), lambda: self.placement.process_alive(slot),
                        lambda: self.calls.healthy(slot), bound_s=self.config.drain_timeout_s,
                        health_interval_s=self.config.health_interval_s, unhealthy_after=self.config.unhealthy_after,
                        say=lambda line: log.info("%s: %s", who, line))
        if drained.end is DrainEnd.BOUND:
            self.event(f"{who}: still busy at the drain bound ({self.config.drain_timeout_s:g}s: "
                       f"{drained.last.describe() if drained.last else 'no answer'}); stopping it")
        elif drained.end is DrainEnd.WEDGED:
            self.event(f"{who}: wedged while draining; stopping it")
        elif drained.end is DrainEnd.GONE:
            self.event(f"{who}: its process ended while draining")
        metrics.DRAINS.labels(slot.role, drained.end.value).inc()
        metrics.DRAIN_SECONDS.labels(slot.role).observe(drained.seconds)
        return drained

    def _retire(self, slot: Slot, drained: Drained) -> None:
        """A drained worker leaves: its process stopped, its host and placement freed."""
        bound = stop_bound_s(slot)
        quietly(lambda: ray.get(slot.host.stop.remote(bound), timeout=bound + 30))
        self.placement.remove(slot)
        with self.membership.lock:
            self.membership.draining = [s for s in self.membership.draining if s is not slot]
        self.event(f"{slot.role} worker {slot.worker_id}: removed ({drained.end.value} after {drained.seconds:.1f}s "
                   "of draining)")

    def _change_role(self, slot: Slot, role: str, drained: Drained) -> bool:
        """A drained worker becomes a `role` worker in its own process, weights kept
        (deploy/role_change.py), and joins that pool; False if it did not (it is then still
        draining, for `_retire`)."""
        was = f"{slot.role} worker {slot.worker_id}"
        worker_id = self.membership.new_worker_id(role)
        t0 = time.monotonic()
        try:
            report = change_role(self.calls.stub(slot), slot.host, role, worker_id,
                                 self.placement.pool(role).worker_args(),
                                 call_timeout_s=loop_wait_s(slot.stall_bound_s) + self.config.health_timeout_s,
                                 ready_timeout_s=self.config.ready_timeout_s)
        except RoleChangeFailed as e:
            metrics.ROLE_CHANGES.labels(slot.role, role, "failed").inc()
            self.event(f"{was}: could not become a {role} worker ({str(e).splitlines()[0]}); "
                       f"a new {role} worker starts instead")
            return False
        seconds = time.monotonic() - t0
        metrics.ROLE_CHANGES.labels(slot.role, role, "done").inc()
        metrics.ROLE_CHANGE_SECONDS.labels(role).observe(seconds)
        with self.membership.lock:
            self.membership.draining = [s for s in self.membership.draining if s is not slot]
            self.placement.adopt(slot, report)
            slot.role, slot.worker_id, slot.stall_bound_s = role, worker_id, 0.0
            self.membership.pools[role].append(slot)
            self.membership.push()
        self.event(f"{was}: drained in {drained.seconds:.1f}s, is {role} worker {worker_id} now, ready on "
                   f"{slot.address}: role changed in place in {seconds:.1f}s, weights kept")
        return True

    def _add_cold(self, role: str) -> None:
        """One new worker of `role`, started from nothing, in the pool once ready."""
        slot = self.placement.place(role)
        try:
            self.placement.wait_ready(slot)
        except Exception:
            self.placement.remove(slot)
            raise
        self._join(slot)
