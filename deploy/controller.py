"""The controller: a named Ray actor that owns the deployment's membership.

What the `pdserve` CLI calls (deploy/serve.py): `start` starts the gateway
(deploy/gateway_link.py) and both pools, `scale` moves the pools to new sizes, `status`,
`events_since` and `shutdown`. It wires the parts that do the work, each in a file of its
own, and runs their threads:

- deploy/membership.py: the workers by pool and state under one lock, and the push of the
  ready ones to the workers' peers (SetPeers) and the gateway (PUT /admin/workers, through
  the actor on the gateway's node to its loopback-only admin socket), which routes to them
  only;
- deploy/placement.py: a worker placed in a placement group of its own, ready, adopted
  under a new incarnation, removed;
- deploy/worker_calls.py: the gRPC calls to the workers (deep health, Drain, SetPeers);
- deploy/health_rounds.py: the health thread, which heals (restarts, adopts, restores a
  role) and pushes the membership every round;
- deploy/scaling.py: a scale, one at a time: new workers ready before they join, leaving
  ones drained before they stop, a move between the pools a role change in place;
- deploy/planner_loop.py: the online planner's thread, which asks for scales.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray

from deploy.config import DeployConfig
from deploy.gateway_link import GatewayLink
from deploy.health_rounds import HealthRounds
from deploy.hosts import LOG_ROOT
from deploy.internal_ca import make_internal_tls
from deploy.membership import Membership
from deploy.placement import Placement, quietly, stop_bound_s
from deploy.planner_loop import PlannerLoop
from deploy.scaling import Scaling
from deploy.worker_calls import WorkerCalls
from rpc import auth

log = logging.getLogger(__name__)

NAME, NAMESPACE = "pdserve-controller", "pdserve"


class Controller:
    """Methods are called by the `pdserve` CLI through Ray; one background thread runs the
    health rounds, another the planner's. The membership's lock guards the pools and is held
    only for a round or a change of them, never through a placement, a worker's loading or
    a drain; one scale runs at a time (the CLI's and the planner's)."""

    def __init__(self, config: dict, admin_token: str, internal_token: str, driver_node_id: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = cfg = DeployConfig.from_dict(config, "controller")
        self.admin_token = admin_token
        incarnation = f"controller-{int(time.time() * 1000)}"  # its metrics' series: new ones if it restarts
        self.child_env = {auth.ENV: internal_token}  # every worker and the gateway: the gRPC secret
        if cfg.internal_tls == "on":  # and the deployment's CA and certificate (rpc/transport.py)
            self.child_env.update(make_internal_tls().env())
        os.environ.update(self.child_env)  # this process's own channels send the token, over TLS if on
        self.driver_node = driver_node_id
        self.log_dir = str(LOG_ROOT / time.strftime("%Y%m%d-%H%M%S"))
        self.events: list[str] = []
        self.stopping = threading.Event()
        self.gateway = GatewayLink(cfg, self._event)
        self.calls = WorkerCalls(cfg.health_timeout_s, cfg.drain_hand_off, self._event)
        self.membership = Membership(self.calls, self.gateway, incarnation)
        self.placement = Placement(cfg, self.membership, self.calls, self.log_dir, self.child_env, self._event)
        self.health = HealthRounds(cfg, self.membership, self.placement, self.calls, self.gateway, self._event,
                                   self.stopping)
        self.scaling = Scaling(cfg, self.membership, self.placement, self.calls, self._event)
        self.loop: threading.Thread | None = None
        self.planner_loop: threading.Thread | None = None
        self.planner = PlannerLoop(cfg.planner, lambda: self.gateway.url, self.membership.sizes, self.scale,
                                   self._event, self.stopping, self.gateway.tls)

    def start(self) -> dict:
        """Start the gateway and both pools; return when every worker is ready."""
        g = self.config.gateway
        self._event(f"logs on each node under {self.log_dir}")
        self.gateway.start(self.driver_node, self.admin_token, self.log_dir, self.child_env)
        self.scale(self.config.prefill.replicas, self.config.decode.replicas)
        self.gateway.wait()
        self.membership.push()
        self.loop = threading.Thread(target=self.health.run, name="health", daemon=True)
        self.loop.start()
        if self.config.planner.enabled:
            self.planner_loop = threading.Thread(target=self.planner.run, name="planner", daemon=True)
            self.planner_loop.start()
        self._event(f"gateway ready on http://{g.host}:{g.port}")
        return self.status()

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        """Move the pools to these sizes (deploy/scaling.py); return once done."""
        self.scaling.scale(prefill, decode)
        return self.status()

    def status(self) -> dict:
        """A snapshot, without the lock: a scale in progress (workers starting or draining,
        minutes on a slow host) must not make status wait."""
        pools = {role: list(slots) for role, slots in self.membership.pools.items()}
        return {"gateway": self.gateway.url, "log_dir": self.log_dir, "planner": self.planner.last_plan,
                "pools": {role: [s.public() for s in slots] for role, slots in pools.items()},
                "starting": [s.public() for s in list(self.membership.starting)]}

    def shutdown_bound_s(self) -> float:
        """How long `shutdown` may take: its threads, the gateway, then the workers' own bounds."""
        return 30 + 15 + max((stop_bound_s(s) for s in self.membership.pooled()), default=0.0) + 30

    def events_since(self, index: int) -> list[str]:
        return self.events[index:]

    def shutdown(self) -> None:
        """Stop the health loop, the gateway and every worker; free the placement groups."""
        self.stopping.set()
        for thread in (self.loop, self.planner_loop):
            if thread is not None:
                thread.join(timeout=30)
        with self.membership.lock:
            self.gateway.stop()
            slots = self.membership.pooled() + self.membership.starting
            bound = max((stop_bound_s(s) for s in slots), default=0.0)
            quietly(lambda: ray.get([s.host.stop.remote(stop_bound_s(s)) for s in slots], timeout=bound + 30))
            for s in slots:
                self.placement.remove(s)
            self.membership.pools = {"prefill": [], "decode": []}
        self._event("stopped")

    def _event(self, message: str) -> None:
        log.info(message)
        self.events.append(message)


ControllerActor = ray.remote(max_concurrency=16, num_cpus=0)(Controller)
