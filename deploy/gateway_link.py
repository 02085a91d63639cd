"""The controller's side of the gateway: its host actor, started on the driver's node, and
what the controller sends it every round (the ready workers and its own metrics).

The gateway process listens for its membership on an admin socket on its own loopback only
(gateway/front_door/admin_listener.py), so every push goes through its host actor on that node
(deploy/hosts.py `GatewayHost.push_membership`). A restarted gateway starts with empty
worker lists; the next round's push gives them back.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
import urllib.request
from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.config import DeployConfig
from deploy.hosts import GatewayHost

log = logging.getLogger(__name__)


def gateway_tls_context(certfile: str | None) -> ssl.SSLContext | None:
    """A context trusting the gateway's own certificate (None: plain HTTP); the host name
    is not checked, since the controller dials the gateway's node-local address."""
    if not certfile:
        return None
    ctx = ssl.create_default_context(cafile=certfile)
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-issued certificate is its own anchor here
    return ctx


class GatewayLink:
    """One gateway's host actor, from `start` to `stop`; `event` reports what the user should see."""

    def __init__(self, config: DeployConfig, event: Callable[[str], None]):
        self.config = config
        self.event = event
        self.host: ray.actor.ActorHandle | None = None
        self.started = 0.0  # the gateway process's start time: a new one after Ray restarts it

    @property
    def url(self) -> str:
        g = self.config.gateway
        host = "127.0.0.1" if g.host in ("0.0.0.0", "::", "") else g.host
        return f"{'https' if g.ssl_certfile else 'http'}://{host}:{g.port}"

    @functools.cached_property
    def tls(self) -> ssl.SSLContext | None:
        """How the controller (on the gateway's node) checks a TLS gateway: against its own
        certificate, whose names are the public host's, not the address dialled here."""
        return gateway_tls_context(self.config.gateway.ssl_certfile)

    def start(self, driver_node: str, admin_token: str, log_dir: str, env: dict[str, str]) -> None:
        strategy = NodeAffinitySchedulingStrategy(driver_node, soft=False)  # where the user reaches it
        slo = self.config.planner  # one SLO: the planner plans for it, the gateway counts goodput against it
        args = [*self.config.gateway.args(), "--slo-ttft", str(slo.slo_ttft_s), "--slo-tpot", str(slo.slo_tpot_s)]
        self.host = GatewayHost.options(num_cpus=0, scheduling_strategy=strategy).remote(
            self.config.model, self.config.served_name, args, admin_token, log_dir, env)
        self.started = ray.get(self.host.info.remote(), timeout=60)["started"]

    def wait(self, timeout_s: float = 120.0) -> None:
        """Until its /health answers; raise with its log's tail if it exits or takes longer."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2, context=self.tls) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            info = ray.get(self.host.info.remote(), timeout=30)
            if not info["alive"] or time.monotonic() > deadline:
                tail = ray.get(self.host.tail.remote(), timeout=30)
                raise RuntimeError(f"the gateway did not start on {self.url}:\n{tail}")
            time.sleep(0.2)

    def check(self) -> None:
        """A health round's look: a gateway Ray restarted is noted (the push follows); a dead
        process gets its host killed for Ray to restart."""
        try:
            info = ray.get(self.host.info.remote(), timeout=10)
        except Exception:
            return  # Ray is restarting it
        if info["started"] != self.started:
            self.started = info["started"]
            self.event("gateway restarted; pushing the workers to it")
        elif not info["alive"]:
            self.event("gateway process exited; restarting it")
            ray.kill(self.host, no_restart=False)

    def push(self, decode: list[str], prefill: list[str], metrics_text: str, controller: str) -> None:
        """The ready workers and the controller's metrics; a failure waits for the next round."""
        if self.host is None:
            return
        try:
            failed = ray.get(self.host.push_membership.remote(decode, prefill, metrics_text, controller), timeout=30)
        except Exception as e:  # the actor is restarting: the next round pushes again
            failed = str(e)
        if failed:
            log.info("membership push failed: %s", failed)

    def stop(self) -> None:
        if self.host is None:
            return
        try:
            ray.get(self.host.stop.remote(), timeout=15)
        except Exception as e:  # already gone
            log.debug("gateway stop: %s", e)
        ray.kill(self.host, no_restart=True)
        self.host = None
