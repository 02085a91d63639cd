"""The decode worker's Prometheus metrics: where prompts are prefilled, and why a remote
prefill fell back to a local one (in the worker's registry; the gateway's /metrics labels
them with `worker` and `role`)."""

from __future__ import annotations

from prometheus_client import Counter

PREFILLS = Counter("pdserve_prefills", "Requests admitted, by where their prompt is prefilled (remote, local)",
                   ["where"])
FALLBACKS = Counter("pdserve_prefill_fallbacks", "Remote prefills that ended prefilled here, by cause: "
                    "send_failed, workers_exhausted, deadline, abort_unconfirmed", ["cause"])
for _where in ("remote", "local"):  # every series present (at 0) from the start, as a dashboard expects
    PREFILLS.labels(_where)
for _cause in ("send_failed", "workers_exhausted", "deadline", "abort_unconfirmed"):
    FALLBACKS.labels(_cause)
