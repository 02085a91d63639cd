"""The serving benchmark's metrics, pure (no I/O): request records, and their percentiles,
SLO attainment and goodput. The statistics themselves are deploy/planner/slo.py's, the
planner's and the simulator's too (their meaning for a measured run is in bench/serving.py's
docstring)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from deploy.planner.slo import QUANTILES, SLO, attainment, passes, percentile
from deploy.planner.slo import TARGET_ATTAINMENT as GOOD_ATTAINMENT

__all__ = ["GOOD_ATTAINMENT", "QUANTILES", "SLO", "Load", "RequestRecord", "Run", "Status", "distribution", "goodput",
           "met_by", "next_probe", "percentile", "summarize"]


class Status(str, Enum):
    OK = "ok"
    FAILED = "failed"
    REJECTED = "rejected"  # HTTP 429: the server shed it


@dataclass
class RequestRecord:
    prompt_tokens: int
    output_tokens: int = 0
    arrival_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    status: Status = Status.FAILED
    error: str = ""


@dataclass(frozen=True)
class Load:
    """One run's load: open-loop `rate` (req/s) or closed-loop `concurrency`."""

    rate: float | None = None
    concurrency: int | None = None

    @property
    def x(self) -> float:
        return self.rate if self.rate is not None else float(self.concurrency)

    @property
    def key(self) -> str:
        return "rate" if self.rate is not None else "concurrency"


@dataclass
class Run:
    load: Load
    duration_s: float
    summary: dict
    requests: list[RequestRecord]
    started_at: float | None = None  # wall clock (Unix seconds) of the run's time zero: its workers' step logs line up

    def to_json(self) -> dict:
        return {self.load.key: self.load.x if self.load.rate is not None else self.load.concurrency,
                "duration_s": self.duration_s, "started_at": self.started_at, "summary": self.summary,
                "requests": [{**asdict(r), "status": r.status.value} for r in self.requests]}


def met_by(slo: SLO, r: RequestRecord) -> bool:
    """Finished and within every SLO (a one-token output has no TPOT to miss)."""
    return r.status is Status.OK and slo.met(r.ttft_s, r.tpot_s)


def distribution(values: list[float]) -> dict[str, float | None]:
    out = {"mean": sum(values) / len(values) if values else None}
    out.update({f"p{q}": percentile(values, q) for q in QUANTILES})
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    ok = [r for r in records if r.status is Status.OK]
    good = sum(met_by(slo, r) for r in records)
    return {
        "total": len(records), "ok": len(ok),
        "failed": sum(r.status is Status.FAILED for r in records),
        "rejected": sum(r.status is Status.REJECTED for r in records),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_s": distribution([r.ttft_s for r in ok]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": distribution([x for r in ok for x in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "good": good, "slo_attainment": attainment(good, len(records)),
    }


def goodput(runs: list[Run]) -> float | None:
    """Highest passing rate (open loop), or the throughput at the highest passing concurrency."""
    passing = [r for r in runs if passes(r.summary["slo_attainment"])]
    if not passing:
        return None
    best = max(passing, key=lambda r: r.load.x)
    return best.load.rate if best.load.rate is not None else best.summary["request_throughput"]


def next_probe(runs: list[Run], min_gap: float = 0.05) -> float | None:
    """The rate between the highest passing rate (0 if none) and the lowest failing rate
    above it; None when no rate above fails or the two are within `min_gap` (relative)."""
    points = [(r.load.rate, passes(r.summary["slo_attainment"])) for r in runs if r.load.rate is not None]
    lo = max((x for x, ok in points if ok), default=0.0)
    hi = min((x for x, ok in points if not ok and x > lo), default=None)
    if hi is None or (hi - lo) / hi <= min_gap:
        return None
    return (lo + hi) / 2
