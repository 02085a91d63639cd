"""The gateway's Prometheus metrics (GET /metrics): request counts and latencies, which the
deploy controller's planner reads (deploy/planner/online.py), and one gauge series per worker
from its Stats.

With several gateway processes (`python -m gateway --processes N`, gateway/processes.py)
the counters and histograms count what every process served: each child starts with
PROMETHEUS_MULTIPROC_DIR set (prometheus_client keeps their values in files there, one set
per process id), and `count_across_processes` makes the default registry, which /metrics
serves, read them all (prometheus_client's MultiProcessCollector). A dead child's files stay,
so a restart sends no counter backwards. The gateway has no Gauge objects for that mode to
merge: the per-worker gauges are the workers' Stats as the answering process last read them
(each process reads them every health round), made at each scrape by `WorkerGauges`,
because they describe the workers, not the gateway (a sum over processes would be wrong),
and prometheus_client cannot remove a series in multiprocess mode (a gone worker's would
stay). process_* and python_gc_* describe one process each and are left out there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import GC_COLLECTOR, PROCESS_COLLECTOR, REGISTRY, Counter, Histogram, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from rpc import pdserve_pb2 as pb

REQUESTS = Counter("pdserve_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"])
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30))
E2E = Histogram("pdserve_e2e_seconds", "Request latency", buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
TPOT = Histogram("pdserve_tpot_seconds", "Time per output token after the first",
                 buckets=(.01, .025, .05, .1, .2, .3, .5, 1, 2))
REJECTIONS = Counter("pdserve_rejections", "Requests refused with 429, by reason: tenant_concurrency, tenant_tokens, "
                     "kv_headroom, predicted_ttft, worker_queue_full", ["reason"])
for _reason in ("tenant_concurrency", "tenant_tokens", "kv_headroom", "predicted_ttft", "worker_queue_full"):
    REJECTIONS.labels(_reason)  # every series present (at 0) from the start, as a dashboard expects
CONNECTION_REFUSALS = Counter("pdserve_connection_refusals", "Requests the front door refused before the app saw them, "
                              "by reason: max_connections (503, past --max-connections), stalled_per_ip (429, "
                              "past --max-connections-per-ip stalled connections)", ["reason"])
for _reason in ("max_connections", "stalled_per_ip"):
    CONNECTION_REFUSALS.labels(_reason)
RETRIES = Counter("pdserve_decode_retries", "Requests sent to another decode worker, by when: before_first_token "
                  "(the worker refused it while draining or shutting down, broke, or failed it before any token), "
                  "mid_stream (replayed after the worker died or failed it), handed_off (replayed from a drained "
                  "worker)", ["when"])
for _when in ("before_first_token", "mid_stream", "handed_off"):
    RETRIES.labels(_when)
RETRY_BUDGET = Counter("pdserve_retry_budget", "The gateway's own retries against its retry budget "
                       "(gateway/retry_budget.py), by kind (before_first_token, mid_stream, handed_off) and outcome: "
                       "spent (room at once), waited (for room), refused (its deadline passed while it waited)",
                       ["kind", "outcome"])
for _when in ("before_first_token", "mid_stream", "handed_off"):
    for _outcome in ("spent", "waited", "refused"):
        RETRY_BUDGET.labels(_when, _outcome)
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests")
COMPLETION_TOKENS = Counter("pdserve_completion_tokens", "Output tokens of finished requests")
# Lengths of finished requests: the online planner replays their distribution, not their means.
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_LENGTHS = Histogram("pdserve_request_prompt_tokens", "Prompt tokens per finished request",
                           buckets=LENGTH_BUCKETS)
OUTPUT_LENGTHS = Histogram("pdserve_request_completion_tokens", "Output tokens per finished request (its first choice)",
                           buckets=LENGTH_BUCKETS)
SLO_REQUESTS = Counter("pdserve_slo_requests", "Finished requests by whether they met the SLO (TTFT and TPOT both "
                       "within --slo-ttft / --slo-tpot): the rate of met=\"yes\" is the goodput", ["met"])


@dataclass
class Slo:
    """The latency objective a finished request is counted against (the planner's, under `pdserve serve`)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        return ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


SLO = Slo()
for _met in ("yes", "no"):
    SLO_REQUESTS.labels(_met)
PREFIX_ROUTES = Counter("pdserve_prefix_routes", "Requests ranked by the router, by pool and by what put the first "
                        "worker first: index (the prefix index says it holds the prompt's leading blocks), hash "
                        "(the index had nothing: rendezvous hash of the first blocks), load (the favourite was "
                        "overloaded; for decode: the least work held none of the prompt)", ["pool", "by"])
for _by in ("index", "hash", "load"):
    PREFIX_ROUTES.labels("prefill", _by)
PREFIX_MATCHED_BLOCKS = Counter("pdserve_prefix_matched_blocks", "Prompt blocks the prefix index says the worker "
                                "ranked first holds cached, by pool", ["pool"])
PREFIX_MATCHED_BLOCKS.labels("prefill")
PREFIX_MATCHED_BLOCKS.labels("decode")
for _by in ("index", "load"):
    PREFIX_ROUTES.labels("decode", _by)
PREFIX_SOURCES = Counter("pdserve_prefix_sources", "Requests sent to a decode worker with a sibling named as its "
                         "prefix source (it holds more of the prompt's leading blocks, which the chosen worker "
                         "may fetch instead of computing)")
WORKER_GAUGES = {
    "kv_blocks_free": "Free KV blocks", "kv_blocks_total": "KV blocks", "waiting_requests": "Queued requests",
    "waiting_tokens": "Queued prompt tokens", "running_requests": "Running sequences",
    "prefix_cache_hit_rate": "Prefix-cache hit rate", "kv_blocks_transferred": "KV blocks moved over NIXL",
    "prefix_index_blocks": "Cached blocks the gateway's prefix index holds for the worker (this process's index)",
    "circuit_open": "1 while this gateway process's circuit breaker for the decode worker is open or half open "
                    "(gateway/routing/circuit_breaker.py): requests go elsewhere",
}  # pdserve_worker_<name>{worker}: its help text


class _WorkerSeries:
    """The collector of the pdserve_worker_* gauges: this process's last reading of each
    worker, as one family per gauge at each scrape (registered once, below)."""

    def __init__(self):
        self.by_worker: dict[str, dict[str, float]] = {}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        by_worker = dict(self.by_worker)  # a health round may replace entries meanwhile
        for name, doc in WORKER_GAUGES.items():
            family = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["worker"])
            for worker, gauges in by_worker.items():
                family.add_metric([worker], gauges[name])
            yield family


_WORKER_SERIES = _WorkerSeries()
REGISTRY.register(_WORKER_SERIES)


class WorkerGauges:
    """The per-worker gauges of one app: a worker's series are labelled by its name (an
    incarnation's, else its address) and end when it no longer answers Stats."""

    def __init__(self):
        self.exported: set[str] = set()  # workers with series in the /metrics gauges

    def export(self, stats: dict[str, pb.StatsResponse | None], index_blocks: dict[str, int],
               circuit_open: dict[str, bool] | None = None) -> None:
        """Every answering worker's Stats into its gauges, with the blocks the prefix index
        holds for it and whether its circuit breaker is open (both by address); the series of
        the others removed."""
        series = _WORKER_SERIES.by_worker
        live = {(s.worker or address) for address, s in stats.items() if s is not None}
        for gone in self.exported - live:  # a replaced incarnation: its series end
            series.pop(gone, None)
        self.exported = live
        for address, s in stats.items():
            if s is not None:
                series[s.worker or address] = {
                    "kv_blocks_free": s.free_blocks, "kv_blocks_total": s.total_blocks,
                    "waiting_requests": s.waiting_requests, "waiting_tokens": s.waiting_tokens,
                    "running_requests": s.running_requests, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                    "kv_blocks_transferred": s.kv_blocks_transferred,
                    "prefix_index_blocks": index_blocks.get(address, 0),
                    "circuit_open": float((circuit_open or {}).get(address, False))}


# Every counter and histogram above: a new one is counted across processes without a list to
# keep (one left out of a list made the multi-process gateway fail at start).
_OWN = tuple(v for v in list(globals().values()) if isinstance(v, (Counter, Histogram)))


def count_across_processes(folder: Path) -> None:
    """Make the default registry (what /metrics serves) the counts of every gateway process
    writing to `folder`, this one's included. This process's values go there already when
    PROMETHEUS_MULTIPROC_DIR named `folder` before prometheus_client was imported (the front
    process sets it in each child's environment); refused otherwise, since the counts would
    then be this process's alone."""
    if values.ValueClass is values.MutexValue:
        raise RuntimeError("prometheus_client keeps this process's values in memory: PROMETHEUS_MULTIPROC_DIR "
                           f"must name {folder} in its environment when it starts")
    for collector in (*_OWN, PROCESS_COLLECTOR, GC_COLLECTOR):
        REGISTRY.unregister(collector)
    MultiProcessCollector(REGISTRY, str(folder))
