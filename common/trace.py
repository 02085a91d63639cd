"""A request's life as structured log lines, one per event, in every process it passes.

Each process on the request path (gateway, decode worker, prefill worker) writes an event
when something happens to a request: it arrived, was admitted, its Prefill went out, its
KV was ready, its first token, its end. A line is the logger `pdserve.trace` at INFO with
one JSON object as its message:

    2026-12-03 06:30:00,123 INFO pdserve.trace: {"t":1764743400.1234,"rid":"chatcmpl-..","proc":"decode d0","event":"kv_ready",...}

`t` is wall-clock seconds (time.time()), comparable across the processes of one host (and
across hosts as far as their clocks agree); `rid` is the gateway's request id, the one the
workers know it by. `pdserve trace ID` (deploy/observe/trace.py) joins one request's lines from
every log into a timeline.

Plain log lines rather than OpenTelemetry spans: the processes already log to files that
live beside each other (deploy/process_log.py), the join needs no collector, and a line
costs one json.dumps per event (a handful per request, none per token). The events map
onto spans one to one if a collector is wanted later. PDSERVE_TRACE=0 turns them off.
"""

from __future__ import annotations

import json
import logging
import time

from common import envs

LOGGER_NAME = "pdserve.trace"
# How a request was served, as the gateway's `first_token` event names it (and its answer's
# headers: x-pdserve-<field, dashed>; gateway/served.py): the decode worker; prefill
# "remote" (with the prefill worker and the KV blocks that came over) or "local" (with the
# reason); the prompt tokens the decode worker's prefix cache served; the sibling it fetched
# prompt blocks from, and how many.
SERVED_FIELDS = ("decode_worker", "prefill", "prefill_worker", "kv_blocks", "local_prefill_reason", "cached_tokens",
                 "prefix_source", "prefix_blocks")
_log = logging.getLogger(LOGGER_NAME)
_process = "?"


def set_process(role: str, name: str = "") -> None:
    """Name this process in its events: its role and, for a worker, its id."""
    global _process
    _process = f"{role} {name}".strip()


def process() -> str:
    """This process's name in its events ("decode d0"; "?" before set_process)."""
    return _process


def enabled() -> bool:
    return envs.trace_enabled() and _log.isEnabledFor(logging.INFO)


def wall(monotonic_at: float) -> float:
    """The wall-clock time of a past `time.monotonic()` reading."""
    return time.time() - (time.monotonic() - monotonic_at)


def event(request_id: str, name: str, at: float | None = None, **fields: object) -> None:
    """Record that `name` happened to `request_id` now (or at the monotonic time `at`)."""
    if not enabled():
        return
    record = {"t": round(time.time() if at is None else wall(at), 6), "rid": request_id, "proc": _process,
              "event": name, **fields}
    _log.info("%s", json.dumps(record, separators=(",", ":"), default=str))
