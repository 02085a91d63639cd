"""The online planner's loop in the controller: every `planner.interval_s`, the gateway's
counters since the window began -> a decision from deploy/planner/online.py -> the scale move it
asks for. Windows never span a change; a cool-down follows each move.

It knows the controller only through the callables it is given (no import of
deploy/controller.py), so the membership's lock (deploy/membership.py) and the scaling
(deploy/scaling.py) stay theirs.
"""

from __future__ import annotations

import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy import metrics
from deploy.config import PlannerConfig
from deploy.planner.online import Planner, scrape
from deploy.planner.pools import Pools
from deploy.planner.profile import Profile

log = logging.getLogger(__name__)


@dataclass
class PlannerLoop:
    """One planner thread's state; `run` is the thread's target and returns once `stopping`
    is set."""

    config: PlannerConfig
    gateway_url: Callable[[], str]
    current: Callable[[], Pools]  # the pools' sizes now (read under the membership's lock)
    scale: Callable[[int, int], object]  # (prefill, decode): blocks until the move is done
    event: Callable[[str], None]  # the controller's event log
    stopping: threading.Event
    gateway_tls: ssl.SSLContext | None = None  # how to check a TLS gateway (deploy/gateway_link.py)
    last_plan: str = ""  # the planner's last decision, for status

    def run(self) -> None:
        """Every interval: the gateway's counters since the window began -> a decision."""
        cfg = self.config
        planner = Planner(Profile.load(cfg.profile), cfg.slo_ttft_s, cfg.slo_tpot_s)
        start, start_at, changed_at = None, 0.0, -math.inf
        while not self.stopping.wait(cfg.interval_s):
            try:
                now, counters = time.monotonic(), scrape(self.gateway_url(), context=self.gateway_tls)
                if start is None or counters.requests < start.requests:  # first read, or a restarted gateway
                    start, start_at = counters, now
                    continue
                window = counters.minus(start)
                if window.requests < cfg.min_requests:
                    continue  # the window grows until it has enough requests
                current = self.current()
                if current.prefill == 0 or now - changed_at < cfg.cooldown_s:
                    start, start_at = counters, now  # aggregated, or cooling down: a fresh window
                    continue
                decision = planner.decide(window, now - start_at, current)
                self.last_plan = decision.reason
                metrics.PLANNER_DECISIONS.labels("hold" if decision.target == current else "scale").inc()
                if decision.target == current:
                    self.event(f"planner: {decision.reason}")
                else:
                    self.event(f"planner: {decision.reason}; moving to {decision.target}")
                    self.scale(decision.target.prefill, decision.target.decode)
                    changed_at = time.monotonic()
                start, start_at = scrape(self.gateway_url(), context=self.gateway_tls), time.monotonic()  # windows never span a change
            except Exception as e:  # never let the loop die; the next window tries again
                log.exception("planner round failed")
                self.event(f"planner: round failed: {e}")
