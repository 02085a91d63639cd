"""What a deployment's steps really cost, from its workers' step logs (worker/step_log.py).

The profile prices an engine step as measured alone (deploy/step_cost.py). In a deployment
the same step runs beside the other worker processes, the gateway, the client and Ray on
the same cores, and each loop iteration does more than the step: it applies commands, polls
transfers, schedules, streams every sampled token to the gateway (a decode worker) or posts
the KV pushes of finished prompts and waits briefly for them (a prefill worker). Run with
PDSERVE_STEP_LOG=1, every worker logs each step's shape and times; this fits, per kind of
worker (an aggregated deployment's; a disaggregated one's prefill and decode workers):

    engine step   = price(shape) * (scale + per_token_rate * tokens streamed per second)
    one iteration = engine step + fixed_s + per_sampled_s * rows sampled

The engine step's factor is contention: the cores it shares, and more so the more tokens
the deployment streams (each costs CPU in the decode worker's gRPC threads, the gateway
and the client, all on the same cores); the streamed rate is that of the whole deployment
over the TOKEN_WINDOW_S before the step. Both are fitted by non-negative least squares on
the logged engine times; the loop terms on the rest of each iteration (its own schedule,
execute and output handling, plus the loop's work before the next step when it did not go
idle). A decode worker's sampled rows are the tokens it streams, a prefill worker's the
prompts it finishes (each a push), so one form covers both roles. The simulator prices a
worker's iterations with its kind's terms (Profile.loop_terms) when the profile has them.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deploy.step_cost import nnls, price

_MARK = " pdserve.step: "
# The kinds of worker terms are fitted for: an aggregated deployment's workers (they log as
# decode workers, and prefill too), and a disaggregated one's prefill and decode workers.
KINDS = ("aggregated", "prefill", "decode")
TOKEN_WINDOW_S = 2.0  # the streamed-token rate a step's contention is priced at: over this window before it


@dataclass(frozen=True)
class LoggedStep:
    t: float  # wall-clock start of the iteration
    process: str  # "decode d0", "prefill p0-..."
    shape: object  # deploy.sim_worker.StepShape
    engine_s: float
    busy_s: float  # schedule + execute + output handling
    gap_s: float | None  # the loop's work before this step since the last one (None: it was idle)

    @property
    def role(self) -> str:
        return self.process.split(" ", 1)[0]


@dataclass(frozen=True)
class LoopTerms:
    """One role's step cost in a deployment, relative to the profile (see the module doc)."""

    scale: float
    fixed_s: float
    per_sampled_s: float
    per_token_rate: float = 0.0  # the scale's growth per token/s the deployment streams
    steps: int = 0  # steps it was fitted on
    error: float = 0.0  # mean relative error of the fitted iteration time over those steps

    def iteration_s(self, engine_price_s: float, sampled: int, token_rate: float = 0.0) -> float:
        return (engine_price_s * (self.scale + self.per_token_rate * token_rate) + self.fixed_s
                + self.per_sampled_s * sampled)

    def as_list(self) -> list[float]:
        """As Profile.loop_terms keeps them."""
        return [self.scale, self.fixed_s, self.per_sampled_s, self.per_token_rate]


def read_steps(paths: Iterable[Path]) -> Iterator[LoggedStep]:
    """Every step line in `paths`, in file order (lines cut by rotation are skipped)."""
    from deploy.sim_worker import StepShape  # the engine's scheduler, and torch: not for the simulator's import
    from deploy.trace import json_lines

    for r in json_lines(paths, _MARK):
        try:
            shape = StepShape(tuple(r["decodes"]), tuple((int(s), int(n)) for s, n in r["chunks"]), int(r["sampled"]))
            yield LoggedStep(float(r["t"]), str(r["proc"]), shape, float(r["engine_s"]), float(r["busy_s"]),
                             None if r["gap_s"] is None else float(r["gap_s"]))
        except (ValueError, KeyError, TypeError):
            continue


def iterations(steps: list[LoggedStep]) -> Iterator[tuple[LoggedStep, float]]:
    """(step, its iteration's seconds): its busy time plus the loop's work before the next
    step of the same process, when the loop went on without idling."""
    by_process: dict[str, list[LoggedStep]] = {}
    for s in steps:
        by_process.setdefault(s.process, []).append(s)
    for run in by_process.values():
        run.sort(key=lambda s: s.t)
        for step, after in zip(run, run[1:] + [None]):
            gap = after.gap_s if after is not None and after.gap_s is not None else 0.0
            yield step, step.busy_s + gap


class TokenRate:
    """Tokens streamed per second over the TOKEN_WINDOW_S before a time, from the decode
    workers' steps (each streams its sampled rows as it ends)."""

    def __init__(self, steps: list[LoggedStep]):
        ends = sorted((s.t + s.busy_s, s.shape.num_sampled) for s in steps if s.role == "decode")
        self.times = [t for t, _ in ends]
        self.cumulative = [0]
        for _, n in ends:
            self.cumulative.append(self.cumulative[-1] + n)

    def at(self, t: float) -> float:
        i = bisect.bisect_left(self.times, t - TOKEN_WINDOW_S)
        j = bisect.bisect_right(self.times, t)
        return (self.cumulative[j] - self.cumulative[i]) / TOKEN_WINDOW_S


def fit(coef: list[float], steps: list[LoggedStep]) -> dict[str, LoopTerms]:
    """The terms of each kind of worker in one deployment's steps, against the profile's step
    model `coef` (deploy/step_cost.NAMES order): "prefill" and "decode" if it has prefill
    workers, else "aggregated"."""
    rate = TokenRate(steps)
    disaggregated = any(s.role == "prefill" for s in steps)
    terms = {}
    for role in ("prefill", "decode"):
        kind = role if disaggregated else "aggregated"
        rows = [(s, it, price(coef, s.shape), rate.at(s.t)) for s, it in iterations(steps) if s.role == role]
        rows = [row for row in rows if row[2] > 0]
        if len(rows) < 10:
            continue
        scale, per_rate = nnls([[p, p * r] for _, _, p, r in rows], [s.engine_s for s, _, _, _ in rows])
        fixed, per_sampled = nnls([[1.0, float(s.shape.num_sampled)] for s, *_ in rows],
                                  [it - p * (scale + per_rate * r) for s, it, p, r in rows])
        t = LoopTerms(scale, fixed, per_sampled, per_rate)
        error = statistics.fmean(abs(t.iteration_s(p, s.shape.num_sampled, r) - it) / it for s, it, p, r in rows)
        terms[kind] = LoopTerms(scale, fixed, per_sampled, per_rate, len(rows), error)
    return terms


def describe(terms: dict[str, LoopTerms]) -> str:
    return "; ".join(f"{kind}: steps x({t.scale:.2f} + {t.per_token_rate * 100:.3f} per 100 streamed tokens/s) the "
                     f"profile, +{t.fixed_s * 1e3:.1f} ms per iteration "
                     f"+{t.per_sampled_s * 1e3:.2f} ms per sampled row ({t.steps} steps, {t.error:.1%} mean error)"
                     for kind, t in terms.items())
