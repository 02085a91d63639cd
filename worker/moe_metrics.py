"""A mixture of experts' routing as a Prometheus series: tokens routed to each expert since
the worker started, summed over the model's expert layers, read from the engine at each
scrape (engine/moe.py counts them on the step's own device). An operator sees routing
imbalance as the spread between experts. A dense model exports none."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

NAME = "pdserve_engine_moe_routed_tokens"


class RoutingCollector:
    """The prometheus collector over the current engine's experts (a role change makes a new
    engine: `watch` points it there)."""

    def __init__(self) -> None:
        self.read: Callable[[], list[int] | None] = lambda: None

    def describe(self):
        return [CounterMetricFamily(NAME, _DOC, labels=["expert"])]

    def collect(self):
        counts = self.read()
        if counts is None:
            return []
        family = CounterMetricFamily(NAME, _DOC, labels=["expert"])
        for expert, n in enumerate(counts):
            family.add_metric([str(expert)], n)
        return [family]


_DOC = "Tokens routed to each expert (a token counts once per expert it goes to), over every expert layer"
_COLLECTOR = RoutingCollector()
_registered = False
_lock = threading.Lock()


def watch(read: Callable[[], list[int] | None]) -> None:
    """Export the counts `read` returns (the engine's routed_tokens_per_expert) from now on;
    registered in this process's registry on first use."""
    global _registered
    with _lock:
        _COLLECTOR.read = read
        if not _registered:
            REGISTRY.register(_COLLECTOR)
            _registered = True
