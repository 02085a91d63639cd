"""The one scrape of the whole system: the gateway's own Prometheus registry and every
worker's (the `Worker.Metrics` RPC), merged into one text exposition for GET /metrics.

Each worker's series carry `worker` (role-id-incarnation) and `role` labels, so a replaced
worker's counters start a new series instead of going backwards, and a metric every
process has (process_cpu_seconds, say) is one family whose series tell the processes
apart (the gateway's own carry no such label). A worker that does not answer in time is
left out of that scrape: its series go stale, as a failed scrape target's would."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from rpc import pdserve_pb2 as pb


class _Families:
    """A collector that yields already-built metric families."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge(own: bytes, workers: Iterable[pb.MetricsResponse]) -> bytes:
    """`own` (the gateway's exposition) and each worker's, labelled, as one exposition."""
    families: dict[str, Metric] = {}

    def add(text: str, labels: dict[str, str]) -> None:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif merged.type != family.type:  # a clash between versions of a process: keep the first
                continue
            merged.samples.extend(s._replace(labels={**s.labels, **labels}) for s in family.samples)

    add(own.decode(), {})
    for w in workers:
        add(w.exposition.decode(), {"worker": w.worker, "role": w.role})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)
