"""Prometheus metrics of the KV transfer (prefix pdserve_kv_transfer_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BYTES = Counter("pdserve_kv_transfer_bytes", "KV bytes written to peers", ["peer_role"])
SECONDS = Histogram(
    "pdserve_kv_transfer_seconds", "Time from a request's first posted chunk to its last write done",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
FAILURES = Counter("pdserve_kv_transfer_failures", "Failed KV transfers by reason: timeout, transfer_error (NIXL "
                   "reported the write failed), or the class of what a post raised (a dead peer's disconnect, say)",
                   ["reason"])
for _reason in ("timeout", "transfer_error"):  # present (at 0) before the first failure, as a dashboard expects
    FAILURES.labels(_reason)
IN_FLIGHT = Gauge("pdserve_kv_transfers_in_flight", "Requests with KV writes posted and not yet finished")
