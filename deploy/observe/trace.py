"""`pdserve trace ID`: one request's timeline, joined from every process's log.

The gateway, decode and prefill workers each log a request's events as `pdserve.trace`
lines (common/trace.py). This reads them from the log files under the given folders (by
default every deployment's, under PDSERVE_LOG_DIR), keeps those of one request (by the
gateway's id, or by the client's X-Request-Id, which the gateway's `arrived` event
names), orders them by time and prints them, then splits its time to first token into the
intervals between consecutive events: those add up, by construction, to the TTFT the
gateway saw (arrival to first token), so each interval says where that time went. Its
`served` line says how it was served, as the answer's x-pdserve-* headers did
(gateway/served.py): from the gateway's `first_token` event.

On a Ray cluster each node keeps its processes' logs: gather the deployment's folder from
each node (or point --logs at a shared mount) before joining. Times are wall clock:
events of one host order exactly, those of several hosts as well as their clocks agree.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common import envs
from common.trace import LOGGER_NAME, SERVED_FIELDS
from deploy.observe.logs import json_lines, log_files

_MARK = f" {LOGGER_NAME}: "


@dataclass(frozen=True)
class TraceEvent:
    t: float  # wall-clock seconds
    request_id: str
    process: str  # "gateway 127.0.0.1:8000", "decode <agent>", "prefill <agent>"
    name: str
    fields: dict

    @property
    def role(self) -> str:
        return self.process.split(" ", 1)[0]


@dataclass
class Timeline:
    """One request's events in time order, and the parts of its TTFT."""

    request_id: str
    client_request_id: str | None
    events: list[TraceEvent]
    ttft_s: float | None = None  # gateway arrival -> gateway first token
    parts: list[tuple[TraceEvent, TraceEvent]] = field(default_factory=list)
    served: dict = field(default_factory=dict)  # how it was served (SERVED_FIELDS), as its answer's headers said

    @classmethod
    def of(cls, request_id: str, events: list[TraceEvent]) -> Timeline:
        events = sorted(events, key=lambda e: e.t)
        arrived = next((e for e in events if e.role == "gateway" and e.name == "arrived"), None)
        first = next((e for e in events if e.role == "gateway" and e.name == "first_token"), None)
        line = cls(request_id, arrived.fields.get("client_request_id") if arrived else None, events)
        if first is not None:
            line.served = {k: first.fields[k] for k in SERVED_FIELDS if first.fields.get(k) is not None}
        if arrived is not None and first is not None:
            line.ttft_s = first.t - arrived.t
            span = [e for e in events if arrived.t <= e.t <= first.t]
            line.parts = list(zip(span, span[1:]))
        return line

    def to_dict(self) -> dict:
        t0 = self.events[0].t if self.events else 0.0
        return {
            "request_id": self.request_id, "client_request_id": self.client_request_id, "ttft_s": self.ttft_s,
            "served": self.served,
            "events": [{"t": e.t, "offset_s": e.t - t0, "request_id": e.request_id, "process": e.process,
                        "event": e.name, **e.fields} for e in self.events],
            "ttft_parts": [{"from": f"{a.role} {a.name}", "to": f"{b.role} {b.name}", "seconds": b.t - a.t}
                           for a, b in self.parts],
        }

    def render(self) -> str:
        if not self.events:
            return f"request {self.request_id}: no trace events"
        t0 = self.events[0].t
        head = f"request {self.request_id}" + (f" (X-Request-Id {self.client_request_id})"
                                               if self.client_request_id else "")
        width = max(len(e.process) for e in self.events)
        rows = [head]
        if self.served:
            rows.append("served: " + " ".join(f"{k}={v}" for k, v in self.served.items()))
        rows.append(f"  {'at ms':>9}  {'+ms':>8}  {'process':<{width}}  {'event':<15} details")
        prev = t0
        for e in self.events:
            details = " ".join(f"{k}={_fmt(k, v)}" for k, v in e.fields.items() if v is not None)
            rows.append(f"  {(e.t - t0) * 1e3:9.1f}  {(e.t - prev) * 1e3:8.1f}  {e.process:<{width}}  "
                        f"{e.name:<15} {details}")
            prev = e.t
        if self.ttft_s is None:
            rows.append("no TTFT: the gateway logged no first token for it (refused, cancelled or failed)")
            return "\n".join(rows)
        rows.append(f"TTFT {self.ttft_s * 1e3:.1f} ms (gateway arrival to first token), of which:")
        for a, b in self.parts:
            what = f"{a.role} {a.name} -> " + (f"{b.name}" if b.role == a.role else f"{b.role} {b.name}")
            rows.append(f"  {(b.t - a.t) * 1e3:9.1f} ms  {what}")
        return "\n".join(rows)


def _fmt(key: str, v: object) -> str:
    if key.endswith("_s") and isinstance(v, (int, float)):  # seconds, shown as milliseconds
        return f"{v * 1e3:.1f}ms"
    return str(v)


def read_events(paths: Iterable[Path], needles: Iterable[str] = ()) -> Iterator[TraceEvent]:
    """The trace events in `paths` (only lines holding one of `needles`, when given: a fast filter)."""
    for rec in json_lines(paths, _MARK, needles):
        try:
            yield TraceEvent(float(rec.pop("t")), str(rec.pop("rid")), str(rec.pop("proc")), str(rec.pop("event")),
                             rec)
        except (KeyError, TypeError, ValueError):
            continue  # not ours


def _same_request(request_id: str, candidate: str) -> bool:
    """The gateway's id, or a retry's or a replay's (the gateway retries a decode worker that
    failed before the first token as ID-retry, and replays one that failed mid-stream as
    ID-replayK)."""
    return candidate == request_id or candidate.startswith((request_id + "-retry", request_id + "-replay"))


def timelines(paths: list[Path], wanted: str) -> list[Timeline]:
    """The timelines of `wanted`: a gateway request id, or a client's X-Request-Id (which may
    name several requests: one timeline each, in order of arrival)."""
    events = list(read_events(paths, [wanted]))
    rids = {e.request_id for e in events if e.role == "gateway" and e.name == "arrived"
            and e.fields.get("client_request_id") == wanted}
    if rids:  # a client's id: the workers' lines name only the gateway's ids (one more pass, for all of them)
        events = list(read_events(paths, rids))
    elif any(_same_request(wanted, e.request_id) for e in events):
        rids = {wanted}
    lines = [Timeline.of(rid, [e for e in events if _same_request(rid, e.request_id)]) for rid in rids]
    return sorted(lines, key=lambda line: line.events[0].t if line.events else 0.0)


def add_command(sub) -> None:
    p = sub.add_parser("trace", help="one request's timeline across gateway, decode and prefill logs",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("request_id", help="the gateway's id (the completion's id, chatcmpl-...) or the X-Request-Id")
    p.add_argument("--logs", type=Path, action="append",
                   help=f"a log folder or file (repeatable; default: every deployment's, {envs.log_dir()})")
    p.add_argument("--json", action="store_true", help="print the timeline as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    roots = args.logs or [envs.log_dir()]
    paths = log_files(roots)
    if not paths:
        print(f"no logs under {', '.join(map(str, roots))}", file=sys.stderr)
        return 1
    found = timelines(paths, args.request_id)
    if not found:
        print(f"no trace events of {args.request_id!r} in {len(paths)} log files under "
              f"{', '.join(map(str, roots))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([t.to_dict() for t in found], indent=1))
    else:
        print("\n\n".join(t.render() for t in found))
    return 0
