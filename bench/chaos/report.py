"""How a request ended (`Record`), what a scenario found (`Result`) and the table of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Outcome(str, Enum):
    COMPLETED = "completed"
    FAILED_CLEANLY = "failed cleanly"
    DROPPED = "dropped"
    HUNG = "hung"
    CANCELLED = "cancelled"  # the client left on purpose


@dataclass
class Record:
    outcome: Outcome = Outcome.DROPPED
    status: int | None = None  # HTTP status, once the answer began
    code: str | None = None  # an error's "code" (a 429's: overloaded, or a tenant limit)
    sent_at: float | None = None  # time.monotonic() when sent
    answered_s: float | None = None  # sent -> response headers
    heard_at: float | None = None  # time.monotonic() of the last sign of life: sent, headers, an SSE event
    ttft_s: float | None = None  # sent -> first text
    chunks: int = 0  # SSE chunks that carried text
    max_gap_s: float = 0.0  # the longest wait between two text chunks (a stream's worst stall)
    gaps_s: list[float] = field(default_factory=list)  # every wait between two text chunks (inter-token latency)
    usage: dict | None = None  # a non-streamed answer's "usage" (prompt_tokens_details.cached_tokens...)
    error: str = ""


@dataclass
class Result:
    scenario: str
    completed: int = 0
    failed_cleanly: int = 0
    dropped: int = 0
    hung: int = 0
    cancelled: int = 0
    http_5xx: int = 0
    leaked_blocks: int | None = None  # None: a worker did not answer Stats
    recovery_s: float | None = None  # fault scenarios only
    replaced_s: float | None = None  # fault -> the new incarnation (or gateway) ready
    dropped_ok: bool = False  # the gateway itself was killed: its clients see cut connections
    fault: bool = False
    no_5xx: bool = False  # the scenario sends nothing a healthy server may answer with a 5xx
    broken: list[str] = field(default_factory=list)  # what else the scenario found wrong
    slow: list[str] = field(default_factory=list)  # missed speed bounds: the bench reports them, tests do not
    figures: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def count(self, records: list[Record]) -> Result:
        for r in records:
            name = r.outcome.name.lower()
            setattr(self, name, getattr(self, name) + 1)
            self.http_5xx += r.status is not None and r.status >= 500
        return self

    def problems(self, speed: bool = True) -> list[str]:
        """What the issue's figures forbid: hangs, leaks, 5xx under abuse, lost recovery; and
        with `speed`, a missed latency bound (tests assert no speed)."""
        out = ([f"{self.hung} hung"] if self.hung else []) + self.broken + (self.slow if speed else [])
        if self.leaked_blocks != 0:
            out.append(f"leaked blocks: {self.leaked_blocks} ({self.figures.get('held')})")
        if self.dropped and not self.dropped_ok:
            out.append(f"{self.dropped} dropped (cut streams or non-JSON errors)")
        if self.no_5xx and self.http_5xx:
            out.append(f"{self.http_5xx} responses with a 5xx status")
        if self.fault and self.recovery_s is None:
            out.append("no fresh request succeeded after the fault")
        return out


def table(results: list[Result]) -> str:
    head = ("scenario", "completed", "failed cleanly", "dropped", "hung", "leaked blocks", "recovery s", "notes")
    rows = [head] + [(r.scenario, str(r.completed), str(r.failed_cleanly), str(r.dropped), str(r.hung),
                      "?" if r.leaked_blocks is None else str(r.leaked_blocks),
                      "-" if r.recovery_s is None else f"{r.recovery_s:.1f}",
                      "; ".join(r.notes + [f"PROBLEM: {p}" for p in r.problems()])) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)
