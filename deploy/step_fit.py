"""What a deployment's steps really cost, from its workers' step logs (worker/step_log.py).

The profile prices an engine step as measured alone (deploy/step_cost.py). In a deployment
the same step runs beside the other worker processes, the gateway, the client and Ray on
the same cores, and each loop iteration does more than the step: it applies commands, polls
transfers, schedules, streams every sampled token to the gateway (a decode worker) or posts
the KV pushes of finished prompts and waits briefly for them (a prefill worker). Run with
PDSERVE_STEP_LOG=1, every worker logs each step's shape and times; this fits, per role:

    engine step   = scale * price(shape)                  # contention on the engine's work
    one iteration = engine step + fixed_s + per_sampled_s * rows sampled

`scale` is the ratio of the logged engine time to the profile's price over all steps (a
time-weighted mean: long steps count as much as they take); the loop terms are fitted by
non-negative least squares on the rest of each iteration (its own schedule, execute and
output handling, plus the loop's work before the next step when it did not go idle). A
decode worker's sampled rows are the tokens it streams, a prefill worker's the prompts it
finishes (each a push), so one form covers both roles. The simulator prices a worker's
iterations with its role's terms (Profile.loop_terms) when the profile has them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deploy.sim_worker import StepShape
from deploy.step_cost import nnls, price

_MARK = " pdserve.step: "
ROLES = ("prefill", "decode")  # an aggregated worker is a decode worker that prefills too


@dataclass(frozen=True)
class LoggedStep:
    t: float  # wall-clock start of the iteration
    process: str  # "decode d0", "prefill p0-..."
    shape: StepShape
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
    steps: int = 0  # steps it was fitted on
    error: float = 0.0  # mean relative error of the fitted iteration time over those steps

    def iteration_s(self, engine_price_s: float, sampled: int) -> float:
        return self.scale * engine_price_s + self.fixed_s + self.per_sampled_s * sampled


def read_steps(paths: Iterable[Path]) -> Iterator[LoggedStep]:
    """Every step line in `paths`, in file order (lines cut by rotation are skipped)."""
    for path in paths:
        try:
            f = path.open(errors="replace")
        except OSError:
            continue
        with f:
            for line in f:
                i = line.find(_MARK)
                if i < 0:
                    continue
                try:
                    r = json.loads(line[i + len(_MARK):])
                    shape = StepShape(tuple(r["decodes"]), tuple((int(s), int(n)) for s, n in r["chunks"]),
                                      int(r["sampled"]))
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


def fit(coef: list[float], steps: list[LoggedStep]) -> dict[str, LoopTerms]:
    """Each role's terms against the profile's step model `coef` (deploy/step_cost.NAMES order)."""
    terms = {}
    for role in ROLES:
        rows = [(s, it, price(coef, s.shape)) for s, it in iterations(steps) if s.role == role]
        rows = [(s, it, p) for s, it, p in rows if p > 0]
        if len(rows) < 10:
            continue
        scale = sum(s.engine_s for s, _, _ in rows) / sum(p for _, _, p in rows)
        fixed, per_sampled = nnls([[1.0, float(s.shape.num_sampled)] for s, _, _ in rows],
                                  [it - scale * p for s, it, p in rows])
        t = LoopTerms(scale, fixed, per_sampled, len(rows))
        error = statistics.fmean(abs(t.iteration_s(p, s.shape.num_sampled) - it) / it for s, it, p in rows)
        terms[role] = LoopTerms(scale, fixed, per_sampled, len(rows), error)
    return terms


def describe(terms: dict[str, LoopTerms]) -> str:
    return "; ".join(f"{role}: steps x{t.scale:.2f} the profile, +{t.fixed_s * 1e3:.1f} ms per iteration "
                     f"+{t.per_sampled_s * 1e3:.2f} ms per sampled row ({t.steps} steps, {t.error:.1%} mean error)"
                     for role, t in terms.items())
