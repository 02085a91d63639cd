"""A mixture of experts' routing as a Prometheus series: tokens routed to each expert since
the worker started, summed over the model's expert layers, read from the engine at each
scrape (engine/moe.py counts them on the step's own device). An operator sees routing
imbalance as the spread between experts. A dense model exports none."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from worker.watched_collector import WatchedCollector

NAME = "pdserve_engine_moe_routed_tokens"
_DOC = "Tokens routed to each expert (a token counts once per expert it goes to), over every expert layer"


def _families(counts: list[int]) -> list:
    family = CounterMetricFamily(NAME, _DOC, labels=["expert"])
    for expert, n in enumerate(counts):
        family.add_metric([str(expert)], n)
    return [family]


_COLLECTOR = WatchedCollector(_families, lambda: [CounterMetricFamily(NAME, _DOC, labels=["expert"])])
# watch(read): export the counts `read` returns (the engine's routed_tokens_per_expert) from now on
watch = _COLLECTOR.watch
