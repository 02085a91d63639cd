"""The controller: a named Ray actor that owns the deployment's membership.

It places each worker in a placement group of its own (one bundle with the pool's
resources, so a pool grows and shrinks one worker at a time and a TP group can later be
several bundles of one group), starts the gateway, and every health round:

- reads each host actor's `info()` (a HostReport; states and reports: deploy/slot.py, the
  decisions they lead to: deploy/health.py): a host Ray is restarting, or whose worker process died,
  is out of the membership until its new incarnation is ready (a dead process is restarted
  by killing its host: Ray brings the actor back, which starts a fresh process);
- deep-checks each worker over gRPC: `Health(deep=True)` says whether its engine loop is
  making progress (a busy worker by its last completed step against its own stall bound,
  an idle one by a probe through the loop: worker/liveness.py), so a slow, busy worker is
  kept and only a wedged one (or one that does not answer) fails; `unhealthy_after`
  failures in a row and the host is restarted, with the worker's own account logged;
- pushes the ready workers to the gateway (PUT /admin/workers, through the actor on the gateway's node to
  its loopback-only admin socket), which routes to them only.

`scale` adds workers (ready before they join) and removes the newest ones after draining
them: out of the membership first, then stopped once each confirms it holds nothing
(deploy/drain.py), is wedged, or `drain_timeout_s` passed. A move between the pools
drains a worker of one and changes its role in place to join the other, its weights
kept, instead of starting a new one cold (deploy/role_change.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy import metrics
from deploy.config import DeployConfig, PoolConfig
from deploy.drain import DrainEnd, Drained, drain, holdings_of
from deploy.health import Action, judge_health, judge_report
from deploy.gateway_link import GatewayLink
from deploy.hosts import LOG_ROOT, WorkerHost
from deploy.planner_loop import PlannerLoop
from deploy.role_change import Moves, RoleChangeFailed, change_role, in_place_moves
from deploy.planner.pools import Pools
from deploy.slot import HostReport, Slot, SlotState
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from transfer.handshake import agent_name
from worker.holdings import Holdings, loop_wait_s, shutdown_bound_s

log = logging.getLogger(__name__)

NAME, NAMESPACE = "pdserve-controller", "pdserve"
PLACEMENT_TIMEOUT_S = 60.0  # a bundle the cluster cannot place in this time is an error


class Controller:
    """Methods are called by the `pdserve` CLI through Ray; one background thread runs the
    health rounds. `lock` guards the pools and is held only for a round or a change of
    them, never through a placement, a worker's loading or a drain; `scaling` lets one
    scale run at a time (the CLI's and the planner's)."""

    def __init__(self, config: dict, admin_token: str, internal_token: str, driver_node_id: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = DeployConfig.from_dict(config, "controller")
        self.admin_token = admin_token
        self.incarnation = f"controller-{int(time.time() * 1000)}"  # its metrics' series: new ones if it restarts
        self.child_env = {auth.ENV: internal_token}  # every worker and the gateway: the gRPC secret
        os.environ[auth.ENV] = internal_token  # this process's own channels send it
        self.driver_node = driver_node_id
        self.log_dir = str(LOG_ROOT / time.strftime("%Y%m%d-%H%M%S"))
        self.pools: dict[str, list[Slot]] = {"prefill": [], "decode": []}
        self.draining: list[Slot] = []  # out of the pools and the routing, still finishing their work
        self.starting: list[Slot] = []  # placed by a scale, not ready yet: in no pool
        self._peers_sent: dict[str, list[str]] = {}  # worker address -> the peers it was sent (SetPeers)
        self.next_id = {"prefill": 0, "decode": 0}
        self.gateway = GatewayLink(self.config, self._event)
        self.events: list[str] = []
        self.lock = threading.RLock()  # the pools and slots: held briefly, never through a placement or a drain
        self.scaling = threading.Lock()  # one scale at a time
        self.stopping = threading.Event()
        self.channels: dict[str, grpc.Channel] = {}
        self.loop: threading.Thread | None = None
        self.planner_loop: threading.Thread | None = None
        self.planner = PlannerLoop(self.config.planner, lambda: self.gateway.url, self._pool_sizes, self.scale,
                                   self._event, self.stopping)

    # ---- what the CLI calls -------------------------------------------------------------

    def start(self) -> dict:
        """Start the gateway and both pools; return when every worker is ready."""
        g = self.config.gateway
        self._event(f"logs on each node under {self.log_dir}")
        self.gateway.start(self.driver_node, self.admin_token, self.log_dir, self.child_env)
        self.scale(self.config.prefill.replicas, self.config.decode.replicas)
        self.gateway.wait()
        self._push_membership()
        self.loop = threading.Thread(target=self._health_loop, name="health", daemon=True)
        self.loop.start()
        if self.config.planner.enabled:
            self.planner_loop = threading.Thread(target=self.planner.run, name="planner", daemon=True)
            self.planner_loop.start()
        self._event(f"gateway ready on http://{g.host}:{g.port}")
        return self.status()

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        if decode is not None and decode < 1:
            raise ValueError("the decode pool needs at least one worker")
        if prefill is not None and prefill < 0:
            raise ValueError("the prefill pool cannot have fewer than 0 workers")
        targets = {"prefill": prefill, "decode": decode}
        for role, target in targets.items():
            if target is not None:
                metrics.POOL_TARGET.labels(role).set(target)
        t0 = time.monotonic()
        with self.scaling:  # one scale at a time; health rounds and replacements go on meanwhile
            with self.lock:
                before = {role: len(slots) for role, slots in self.pools.items()}
            moves = in_place_moves(before, targets, self.config)  # these change role instead of starting cold
            self._grow(targets, moves)
            with self.lock:
                leaving = []
                for role, target in targets.items():
                    while target is not None and len(self.pools[role]) > target:
                        leaving.append(self.pools[role].pop())  # the newest first
                for slot in leaving:
                    slot.state = SlotState.DRAINING
                    self.draining.append(slot)
                if leaving:
                    self._push_membership()  # out of routing now; the rounds go on while they drain
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
        return self.status()

    def _grow(self, targets: dict[str, int | None], moves: Moves | None) -> None:
        """Place the new workers (all first: they load in parallel) and add each to its pool
        once ready. Without the lock: placement and loading take minutes on a slow host, and
        health rounds, replacements and membership pushes must go on meanwhile."""
        new: list[Slot] = []
        try:
            for role, target in targets.items():
                moved_in = moves.count if moves and moves.target == role else 0
                for _ in range(0 if target is None else target - len(self.pools[role]) - moved_in):
                    new.append(self._place(role))
            for slot in new:
                self._wait_ready(slot)
                self._join(slot)
        except Exception:
            for slot in new:
                if slot in self.starting:  # not ready: in no pool
                    self._remove(slot)
            raise

    def _join(self, slot: Slot) -> None:
        """A new worker, ready: into its pool and the membership."""
        with self.lock:
            self.starting.remove(slot)
            self.pools[slot.role].append(slot)
            self._push_membership()

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
        self._event(f"scale ({kind}: {sizes}{moved}) done in {seconds:.1f}s: new workers ready after {ready_s:.1f}s, "
                    f"leaving ones drained (and moved or stopped) {seconds - ready_s:.1f}s later")

    def status(self) -> dict:
        """A snapshot, without the lock: a scale in progress (workers starting or draining,
        minutes on a slow host) must not make status wait."""
        pools = {role: list(slots) for role, slots in self.pools.items()}
        return {"gateway": self.gateway.url, "log_dir": self.log_dir, "planner": self.planner.last_plan,
                "pools": {role: [s.public() for s in slots] for role, slots in pools.items()},
                "starting": [s.public() for s in list(self.starting)]}

    def shutdown_bound_s(self) -> float:
        """How long `shutdown` may take: its threads, the gateway, then the workers' own bounds."""
        slots = [s for pool in self.pools.values() for s in pool]
        return 30 + 15 + max((self._stop_bound_s(s) for s in slots), default=0.0) + 30

    def events_since(self, index: int) -> list[str]:
        return self.events[index:]

    def shutdown(self) -> None:
        """Stop the health loop, the gateway and every worker; free the placement groups."""
        self.stopping.set()
        for thread in (self.loop, self.planner_loop):
            if thread is not None:
                thread.join(timeout=30)
        with self.lock:
            self.gateway.stop()
            slots = [s for pool in self.pools.values() for s in pool] + self.starting
            bound = max((self._stop_bound_s(s) for s in slots), default=0.0)
            _quietly(lambda: ray.get([s.host.stop.remote(self._stop_bound_s(s)) for s in slots], timeout=bound + 30))
            for s in slots:
                self._remove(s)
            self.pools = {"prefill": [], "decode": []}
        self._event("stopped")

    # ---- pools --------------------------------------------------------------------------

    def _pool(self, role: str) -> PoolConfig:
        return self.config.prefill if role == "prefill" else self.config.decode

    def _place(self, role: str) -> Slot:
        pool = self._pool(role)
        with self.lock:
            worker_id = str(self.next_id[role])
            self.next_id[role] += 1
        bundle = pool.bundle()
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"pdserve-{role}-{worker_id}")
        if not _wait(pg.ready(), PLACEMENT_TIMEOUT_S):
            remove_placement_group(pg)
            raise RuntimeError(f"cannot place a {role} worker: no node has {bundle} free "
                               f"(waited {PLACEMENT_TIMEOUT_S:.0f}s)")
        options = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": dict(pool.resources),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}
        host = WorkerHost.options(**options).remote(role, worker_id, self.config.model, self.config.dtype,
                                                    pool.worker_args(), self.log_dir, self.child_env)
        self._event(f"{role} worker {worker_id}: placed, loading {self.config.model}")
        slot = Slot(role, worker_id, pg, host)
        with self.lock:
            self.starting.append(slot)
        return slot

    def _wait_ready(self, slot: Slot) -> None:
        slot.address = ray.get(slot.host.ready.remote(self.config.ready_timeout_s),
                               timeout=self.config.ready_timeout_s + 30)
        slot.report = ray.get(slot.host.info.remote(), timeout=30)
        slot.incarnation, slot.node_id = slot.report.incarnation, slot.report.node_id
        slot.state = SlotState.READY
        self._event(f"{slot.role} worker {slot.worker_id}: ready on {slot.address}")

    def _drain(self, slot: Slot) -> Drained:
        """Out of the gateway's membership already; drained until it confirms it holds
        nothing (deploy/drain.py). A slow worker is given the time its requests take; only
        a wedged one, a dead one or the user's bound `drain_timeout_s` cuts the drain short."""
        who = f"{slot.role} worker {slot.worker_id}"
        self._event(f"{who}: draining")
        drained = drain(lambda: self._ask_drain(slot), lambda: self._process_alive(slot), lambda: self._healthy(slot),
                        bound_s=self.config.drain_timeout_s, health_interval_s=self.config.health_interval_s,
                        unhealthy_after=self.config.unhealthy_after, say=lambda line: log.info("%s: %s", who, line))
        if drained.end is DrainEnd.BOUND:
            self._event(f"{who}: still busy at the drain bound ({self.config.drain_timeout_s:g}s: "
                        f"{drained.last.describe() if drained.last else 'no answer'}); stopping it")
        elif drained.end is DrainEnd.WEDGED:
            self._event(f"{who}: wedged while draining; stopping it")
        elif drained.end is DrainEnd.GONE:
            self._event(f"{who}: its process ended while draining")
        metrics.DRAINS.labels(slot.role, drained.end.value).inc()
        metrics.DRAIN_SECONDS.labels(slot.role).observe(drained.seconds)
        return drained

    def _retire(self, slot: Slot, drained: Drained) -> None:
        """A drained worker leaves: its process stopped, its host and placement freed."""
        bound = self._stop_bound_s(slot)
        _quietly(lambda: ray.get(slot.host.stop.remote(bound), timeout=bound + 30))
        self._remove(slot)
        with self.lock:
            self.draining = [s for s in self.draining if s is not slot]
        self._event(f"{slot.role} worker {slot.worker_id}: removed ({drained.end.value} after {drained.seconds:.1f}s "
                    "of draining)")

    def _change_role(self, slot: Slot, role: str, drained: Drained) -> bool:
        """A drained worker becomes a `role` worker in its own process, weights kept
        (deploy/role_change.py), and joins that pool; False if it did not (it is then still
        draining, for `_retire`)."""
        was = f"{slot.role} worker {slot.worker_id}"
        with self.lock:
            worker_id = str(self.next_id[role])
            self.next_id[role] += 1
        t0 = time.monotonic()
        try:
            report = change_role(self._stub(slot), slot.host, role, worker_id, self._pool(role).worker_args(),
                                 call_timeout_s=loop_wait_s(slot.stall_bound_s) + self.config.health_timeout_s,
                                 ready_timeout_s=self.config.ready_timeout_s)
        except RoleChangeFailed as e:
            metrics.ROLE_CHANGES.labels(slot.role, role, "failed").inc()
            self._event(f"{was}: could not become a {role} worker ({str(e).splitlines()[0]}); "
                        f"a new {role} worker starts instead")
            return False
        seconds = time.monotonic() - t0
        metrics.ROLE_CHANGES.labels(slot.role, role, "done").inc()
        metrics.ROLE_CHANGE_SECONDS.labels(role).observe(seconds)
        with self.lock:
            self.draining = [s for s in self.draining if s is not slot]
            self._adopt(slot, report)
            slot.role, slot.worker_id, slot.stall_bound_s = role, worker_id, 0.0
            self.pools[role].append(slot)
            self._push_membership()
        self._event(f"{was}: drained in {drained.seconds:.1f}s, is {role} worker {worker_id} now, ready on "
                    f"{slot.address}: role changed in place in {seconds:.1f}s, weights kept")
        return True

    def _add_cold(self, role: str) -> None:
        """One new worker of `role`, started from nothing, in the pool once ready."""
        slot = self._place(role)
        try:
            self._wait_ready(slot)
        except Exception:
            self._remove(slot)
            raise
        self._join(slot)

    def _ask_drain(self, slot: Slot) -> Holdings | None:
        """The Drain RPC: what the worker holds (it takes nothing new from the first call on;
        a decode worker hands its requests off, with `drain_hand_off`); None when it did not
        answer. The worker answers from its loop, within one step."""
        try:
            hand_off = slot.role == "decode" and self.config.drain_hand_off
            answer = self._stub(slot).Drain(pb.DrainRequest(hand_off=hand_off),
                                            timeout=loop_wait_s(slot.stall_bound_s) + self.config.health_timeout_s)
        except grpc.RpcError as e:
            log.info("%s worker %s: Drain got no answer (%s)", slot.role, slot.worker_id, e.code().name)
            return None
        slot.stall_bound_s = answer.stall_bound_s
        return holdings_of(answer)

    def _process_alive(self, slot: Slot) -> bool:
        try:
            return ray.get(slot.host.info.remote(), timeout=10).alive
        except Exception:  # the host actor itself is gone
            return False

    def _stop_bound_s(self, slot: Slot) -> float:
        """How long the worker's host waits after SIGTERM before SIGKILL: the bound the worker's
        own shutdown is derived from (its stall bound, from its measured steps)."""
        return shutdown_bound_s(slot.stall_bound_s)

    def _adopt(self, slot: Slot, report: HostReport) -> None:
        """The slot's worker is now the one `report` describes (a new incarnation, address)."""
        old = self.channels.pop(slot.address, None)
        if old is not None and report.address != slot.address:
            old.close()
        slot.report, slot.address, slot.incarnation = report, report.address, report.incarnation
        slot.node_id, slot.failures, slot.state = report.node_id, 0, SlotState.READY

    def _remove(self, slot: Slot) -> None:
        with self.lock:
            if slot in self.starting:
                self.starting.remove(slot)
        _quietly(lambda: ray.kill(slot.host, no_restart=True))
        _quietly(lambda: remove_placement_group(slot.pg))
        channel = self.channels.pop(slot.address, None)
        if channel is not None:
            channel.close()

    # ---- health -------------------------------------------------------------------------

    def _health_loop(self) -> None:
        while not self.stopping.wait(self.config.health_interval_s):
            try:
                with self.lock:
                    self._round()
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health round failed")

    def _round(self) -> None:
        for slot in [s for pool in self.pools.values() for s in pool if s.state is not SlotState.DRAINING]:
            self._check(slot)
        self.gateway.check()
        self._push_membership()

    def _check(self, slot: Slot) -> None:
        try:
            report = ray.get(slot.host.info.remote(), timeout=10)
        except Exception:  # the actor died: Ray is restarting it
            report = None
        decision = judge_report(slot, report)
        if decision.action is Action.HOST_LOST:
            metrics.HEALTH_VERDICTS.labels(slot.role, "host_lost").inc()
            if slot.state is not SlotState.RESTARTING:
                self._event(f"{slot.role} worker {slot.worker_id}: host actor lost, Ray restarts it")
                slot.state = SlotState.RESTARTING
        elif decision.action is Action.WAIT:
            slot.state = SlotState.RESTARTING
            _quietly(lambda: ray.get(slot.host.ready.remote(0.5), timeout=10))
        elif decision.action is Action.RESTORE_ROLE:
            self._restore_role(slot, report)
        elif decision.action is Action.ADOPT:
            self._adopt(slot, report)
            slot.restarts += 1
            metrics.HEALTH_VERDICTS.labels(slot.role, "adopted").inc()
            self._event(f"{slot.role} worker {slot.worker_id}: incarnation {slot.incarnation} ready on "
                        f"{slot.address}")
        elif decision.action is Action.RESTART:
            self._restart(slot, decision.why)
        elif self._healthy(slot):
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
        self._event(f"{slot.role} worker {slot.worker_id}: its restarted host started it as {birth} worker "
                    f"{report.worker_id}; changing it back to {slot.role}")
        slot.state, slot.address = SlotState.RESTARTING, report.address
        try:
            self._stub(slot).Drain(pb.DrainRequest(), timeout=self.config.health_timeout_s)  # new: it holds nothing
            report = change_role(self._stub(slot), slot.host, slot.role, slot.worker_id,
                                 self._pool(slot.role).worker_args(), call_timeout_s=self.config.health_timeout_s,
                                 ready_timeout_s=self.config.ready_timeout_s)
        except (grpc.RpcError, RoleChangeFailed) as e:
            metrics.ROLE_CHANGES.labels(birth, slot.role, "failed").inc()
            self._restart(slot, f"could not put it back in its role ({str(e).splitlines()[0]})")
            return
        metrics.ROLE_CHANGES.labels(birth, slot.role, "restored").inc()
        self._adopt(slot, report)
        slot.restarts += 1
        metrics.HEALTH_VERDICTS.labels(slot.role, "adopted").inc()
        self._event(f"{slot.role} worker {slot.worker_id}: incarnation {slot.incarnation} ready on {slot.address}")

    def _restart(self, slot: Slot, why: str) -> None:
        self._event(f"{slot.role} worker {slot.worker_id}: {why}; replacing it with a new incarnation")
        metrics.HEALTH_VERDICTS.labels(slot.role, "restart").inc()
        slot.state, slot.failures = SlotState.RESTARTING, 0
        self.channels.pop(slot.address, None)
        # Its process ends first (SIGKILL: it is wedged or silent), so that once the new
        # incarnation replaces its address, the decode workers may take it as gone.
        _quietly(lambda: ray.get(slot.host.stop.remote(0.0), timeout=30))
        ray.kill(slot.host, no_restart=False)  # Ray restarts the actor, which starts a fresh process

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = auth.channel(address)
        return self.channels[address]

    def _stub(self, slot: Slot) -> pb_grpc.WorkerStub:
        """Health and Stats: the Worker service, which both roles answer."""
        return pb_grpc.WorkerStub(self._channel(slot.address))

    def _healthy(self, slot: Slot) -> bool:
        try:
            h = self._stub(slot).Health(pb.HealthRequest(deep=True), timeout=self.config.health_timeout_s)
        except grpc.RpcError as e:
            self._event(f"{slot.role} worker {slot.worker_id}: deep health got no answer "
                        f"({e.code().name}, {self.config.health_timeout_s:g}s deadline)")
            return False
        slot.stall_bound_s = h.stall_bound_s
        if not h.ok:
            self._event(f"{slot.role} worker {slot.worker_id}: deep health: {h.detail} "
                        f"[last step {h.last_step_age_s:.1f}s ago, queued {h.queued}, "
                        f"longest step {h.longest_step_s:.2f}s, stall bound {h.stall_bound_s:.1f}s]")
        return h.ok

    def _stats(self, slot: Slot) -> pb.StatsResponse | None:
        try:
            return self._stub(slot).Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None

    # ---- planner ------------------------------------------------------------------------

    def _pool_sizes(self) -> Pools:
        """The planner's view of the pools (deploy/planner_loop.py)."""
        with self.lock:
            return Pools(len(self.pools["prefill"]), len(self.pools["decode"]))

    # ---- membership ---------------------------------------------------------------------

    def _push_peers(self) -> None:
        """Every ready prefill worker learns the deployment's decode agents (the ready ones and
        those still draining): the only destinations its KV may go to. Every decode worker
        (ready or draining) learns the address of every worker not removed or replaced: the
        only ones it asks for prefills, and one that left is known gone (its blocks set aside
        for an unconfirmed abort are free again: decode/remote_prefill.py)."""
        slots = [*self.pools["prefill"], *self.pools["decode"], *self.draining]
        serving = [s for s in slots if s.state in (SlotState.READY, SlotState.DRAINING)]
        agents = [agent_name("decode", s.worker_id, s.incarnation) for s in serving if s.role == "decode"]
        workers = sorted(s.address for s in slots if s.address)
        for slot in serving:
            peers = agents if slot.role == "prefill" else workers
            if self._peers_sent.get(slot.address) == peers:
                continue  # it has this list (a restarted worker is a new address)
            stub = pb_grpc.PrefillWorkerStub if slot.role == "prefill" else pb_grpc.DecodeWorkerStub
            request = pb.SetPeersRequest(decode_agents=agents) if slot.role == "prefill" else \
                pb.SetPeersRequest(workers=workers)
            try:
                stub(self._channel(slot.address)).SetPeers(request, timeout=self.config.health_timeout_s)
                self._peers_sent[slot.address] = peers
            except grpc.RpcError as e:  # the next round sends it again; its health check judges it
                log.info("%s worker %s: SetPeers failed: %s", slot.role, slot.worker_id, e.code().name)

    def _push_membership(self) -> None:
        """The prefill workers first, then the gateway: a decode worker is routed to only once
        the prefill workers take its KV destinations."""
        self._push_peers()
        ready = {role: [s.address for s in slots if s.state is SlotState.READY] for role, slots in self.pools.items()}
        counts: dict[tuple[str, str], int] = {}
        for slot in [s for pool in self.pools.values() for s in pool] + self.draining + self.starting:
            counts[slot.role, slot.state.value] = counts.get((slot.role, slot.state.value), 0) + 1
        metrics.set_pools(counts)
        self.gateway.push(ready["decode"], ready["prefill"], metrics.exposition(), self.incarnation)

    def _event(self, message: str) -> None:
        log.info(message)
        self.events.append(message)


def _wait(ref, timeout_s: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # clean-up of something already gone
        log.debug("ignored during clean-up: %s", e)


ControllerActor = ray.remote(max_concurrency=16, num_cpus=0)(Controller)
