"""The decode worker's Prometheus metrics: where prompts are prefilled, and why a remote
prefill fell back to a local one (in the worker's registry; the gateway's /metrics labels
them with `worker` and `role`). A fallback's cause is its pb.LocalPrefill's name
(rpc/convert.py `local_prefill_name`), as the request's answer headers say it."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PREFILLS = Counter("pdserve_prefills", "Requests admitted, by where their KV comes from: remote (a prefill "
                   "worker), local, kv_source (a handed-off request's, from the decode worker that kept it)",
                   ["where"])
MIGRATIONS = Counter("pdserve_migrations", "Handed-off requests whose KV this decode worker kept for its taker, "
                     "by outcome: kept (at the hand-off), then pushed, failed, aborted or expired (not pulled in "
                     "time); refused: a pull for KV not kept here", ["outcome"])
FALLBACKS = Counter("pdserve_prefill_fallbacks", "Remote prefills that ended prefilled here, by cause: "
                    "send_failed, prefill_failed, transfer_failed (every prefill worker tried failed, the last "
                    "in its prefill or in its KV transfer), deadline, abort_unconfirmed", ["cause"])
PREFIX_SERVED = Counter("pdserve_prefix_served_blocks", "KV blocks of this worker's prefix cache pushed to a sibling "
                        "decode worker that fetched them instead of computing them")
STREAMS_DOWN_BYTES = Histogram("pdserve_streams_down_bytes", "Bytes of each message sent on a gateway's Streams call: "
                               "one engine step's news for its streams, or several steps merged while the gateway "
                               "read slowly (bounded by rpc/auth.py MAX_MESSAGE_BYTES, 64 MiB)",
                               buckets=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 4 << 20, 16 << 20, 64 << 20))
for _where in ("remote", "local", "kv_source"):  # every series present (at 0) from the start, as a dashboard expects
    PREFILLS.labels(_where)
for _cause in ("send_failed", "prefill_failed", "transfer_failed", "deadline", "abort_unconfirmed"):
    FALLBACKS.labels(_cause)
for _outcome in ("kept", "pushed", "failed", "aborted", "expired", "refused"):
    MIGRATIONS.labels(_outcome)
