"""What a deployment's steps really cost, from its workers' step logs (worker/step_log.py).

The profile prices an engine step as measured alone (deploy/planner/step_cost.py). In a deployment
the same step runs beside the other worker processes, the gateway, the client and Ray on
the same cores, and each loop iteration does more than the step: it applies commands, polls
transfers, schedules, streams every sampled token to the gateway (a decode worker) or posts
the KV pushes of finished prompts and waits briefly for them (a prefill worker). Run with
PDSERVE_STEP_LOG=1, every worker logs each step's shape and times; this fits, per kind of
worker (an aggregated deployment's; a disaggregated one's prefill and decode workers):

    engine step   = price(shape) * (scale + per_busy * others_busy + per_token_rate * tokens streamed per second)
                    + per_row_s * min(rows sampled, SATURATED_ROWS)
    one iteration = engine step + fixed_s + per_sampled_s * rows sampled

The engine step's factor is contention. Most of it is the other workers: `others_busy` is
the share of the step during which the deployment's other workers were in steps of their
own (0 to 1, averaged over them), and a step beside a busy worker is slower than one beside
an idle worker (cores, caches and memory bandwidth shared: on a 2-core VM an aggregated
worker's step 0.99x the profile beside an idle worker, 1.12x beside a busy one). The rest is `scale`, and the
tokens the deployment streams (each costs CPU in the decode worker's gRPC threads, the
gateway and the client, all on the same cores), over the TOKEN_WINDOW_S before the step.
Each sampled row also costs the engine more than alone (`per_row_s`: the row's token is
streamed by the worker's gRPC threads, which take the interpreter's lock from the engine
thread between its native calls), up to SATURATED_ROWS rows: past that the engine thread
already waits at most of its hand-offs, and more rows add nothing measurable (a 1P+1D
decode worker on a 2-core VM: +1 to +5 ms over the profile from batch 5 to 56, not growing
past 8; a linear term fitted on batches up to 16 put +24 ms on a step of 40). They are
fitted by non-negative least squares on the logged engine times, each weighted by the
inverse of its time (a step's spread grows with its length; so weighted, the fitted times
add up to the measured ones, and 20 ms decode steps are not drowned out by 400 ms chunks),
with one level of the host per LEVEL_WINDOW_S of the log so that a host drifting over
minutes is not read as contention (`scale` is then the log's one level given the terms;
`levels` measures it over any span, such as one bench run). The simulator shares the cores the same way,
a step going slower while other workers step (simulator.py).

What the terms leave is not only step-to-step jitter: a worker's steps stray together for
a second or more (another tenant of the host, the host's own work, anything else run on
it; on a 2-core VM, sd 0.10-0.15 in the log of measured over fitted, lasting 0.3-1.3 s),
and a request's TPOT feels such a stretch whole. `fit_noise` fits
it as an Ornstein-Uhlenbeck process in the log of that ratio (sd and time constant), and
the simulator draws each worker's from it.
The loop terms are fitted on the rest of each iteration as measured (the iteration's time
less its logged engine time: its own schedule and output handling, plus the loop's work
before the next step when it did not go idle), so the engine model's errors stay out of
them. A decode worker's sampled rows are the tokens it streams, a prefill worker's the
prompts it finishes (each a push), so one form covers both roles. The simulator prices a
worker's iterations with its kind's terms (Profile.loop_terms) when the profile has them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deploy.planner.step_cost import nnls, price

_MARK = " pdserve.step: "
# The kinds of worker terms are fitted for: an aggregated deployment's workers (they log as
# decode workers, and prefill too), and a disaggregated one's prefill and decode workers.
KINDS = ("aggregated", "prefill", "decode")
TOKEN_WINDOW_S = 2.0  # the streamed-token rate a step's contention is priced at: over this window before it
NOISE_WINDOWS_S = (0.25, 2.0)  # the windows whose variances fit the steps' noise (fit_noise)
SATURATED_ROWS = 8  # per_row_s stops growing here (see the module doc)
LEVEL_WINDOW_S = 60.0  # the contention terms are fitted with one level of the host per this much of a log


@dataclass(frozen=True)
class LoggedStep:
    t: float  # wall-clock start of the iteration
    process: str  # "decode d0", "prefill p0-..."
    shape: object  # deploy.planner.sim_worker.StepShape
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
    per_busy: float = 0.0  # and with the other workers busy throughout the step
    per_row_s: float = 0.0  # the engine's own extra seconds per sampled row (up to SATURATED_ROWS)
    noise_sd: float = 0.0  # how far a worker's steps stray from the terms (sd of the log of their ratio)
    noise_s: float = 0.0  # and for how long a stray lasts (the time constant of its decay)
    steps: int = 0  # steps it was fitted on
    error: float = 0.0  # mean relative error of the fitted iteration time over those steps

    def engine_s(self, engine_price_s: float, sampled: int, token_rate: float = 0.0, others_busy: float = 0.0) -> float:
        return (engine_price_s * (self.scale + self.per_token_rate * token_rate + self.per_busy * others_busy)
                + self.per_row_s * min(sampled, SATURATED_ROWS))

    def iteration_s(self, engine_price_s: float, sampled: int, token_rate: float = 0.0,
                    others_busy: float = 0.0) -> float:
        return (self.engine_s(engine_price_s, sampled, token_rate, others_busy) + self.fixed_s
                + self.per_sampled_s * sampled)

    def as_list(self) -> list[float]:
        """As Profile.loop_terms keeps them."""
        return [self.scale, self.fixed_s, self.per_sampled_s, self.per_token_rate, self.per_busy, self.per_row_s,
                self.noise_sd, self.noise_s]

    @classmethod
    def of(cls, terms: list[float]) -> LoopTerms:
        """From Profile.loop_terms' list (older profiles have fewer: the rest are 0)."""
        return cls(*(*terms, *[0.0] * 8)[:8])


def read_steps(paths: Iterable[Path]) -> Iterator[LoggedStep]:
    """Every step line in `paths`, in file order (lines cut by rotation are skipped)."""
    from deploy.planner.sim_worker import StepShape  # the engine's scheduler, and torch: not for the simulator's import
    from deploy.observe.logs import json_lines

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


class OthersBusy:
    """The share of a time span during which a process's fellow workers were in steps
    (0: all idle, 1: all of them busy throughout), from their logged steps."""

    def __init__(self, steps: list[LoggedStep]):
        self.spans: dict[str, list[tuple[float, float]]] = {}
        for s in steps:
            self.spans.setdefault(s.process, []).append((s.t, s.t + s.busy_s))
        for spans in self.spans.values():
            spans.sort()
        self.longest = {p: max(b - a for a, b in spans) for p, spans in self.spans.items()}

    def over(self, process: str, start: float, end: float) -> float:
        others = [p for p in self.spans if p != process]
        if not others or end <= start:
            return 0.0
        covered = 0.0
        for p in others:
            spans = self.spans[p]
            i = bisect.bisect_left(spans, (start - self.longest[p],))
            while i < len(spans) and spans[i][0] < end:
                covered += max(0.0, min(end, spans[i][1]) - max(start, spans[i][0]))
                i += 1
        return min(1.0, covered / (end - start) / len(others))


def _window_variances(runs: list[list[tuple[float, float, float]]], window_s: float) -> float:
    """Variance of log(measured / predicted) over consecutive windows of `window_s` seconds of
    each process's iterations ((start, measured, predicted) in time order)."""
    logs = []
    for run in runs:
        i = 0
        while i < len(run):
            j, measured, predicted = i, 0.0, 0.0
            while j < len(run) and run[j][0] < run[i][0] + window_s:
                measured, predicted, j = measured + run[j][1], predicted + run[j][2], j + 1
            if predicted > 0 and measured > 0:
                logs.append(math.log(measured / predicted))
            i = j
    return statistics.pvariance(logs) if len(logs) > 2 else 0.0


def fit_noise(runs: list[list[tuple[float, float, float]]]) -> tuple[float, float]:
    """(sd, time constant) of a stationary Ornstein-Uhlenbeck process in log(measured /
    predicted) that gives the variance the iterations show over short windows (NOISE_WINDOWS_S[0])
    and how much of it is left over longer ones (NOISE_WINDOWS_S[1]): a slow host stretch
    (another tenant, the host's own work) lasts seconds, and a request's TPOT feels it whole."""
    short, long = NOISE_WINDOWS_S
    v_short, v_long = _window_variances(runs, short), _window_variances(runs, long)
    if v_short <= 0.0:
        return 0.0, 0.0

    def kept(window_s: float, tau: float) -> float:  # share of an OU process's variance in a window's mean
        x = window_s / tau
        return 2 * (x - 1 + math.exp(-x)) / (x * x)

    lo, hi = 0.01, 100.0  # bisect the time constant whose windows keep the measured share
    target = min(v_long / v_short, 0.999)
    for _ in range(60):
        tau = math.sqrt(lo * hi)
        if kept(long, tau) / kept(short, tau) < target:
            lo = tau
        else:
            hi = tau
    tau = math.sqrt(lo * hi)
    return math.sqrt(v_short / kept(short, tau)), tau


def fit(coef: list[float], steps: list[LoggedStep]) -> dict[str, LoopTerms]:
    """The terms of each kind of worker in one deployment's steps, against the profile's step
    model `coef` (deploy/planner/step_cost.NAMES order): "prefill" and "decode" if it has prefill
    workers, else "aggregated"."""
    rate, busy = TokenRate(steps), OthersBusy(steps)
    disaggregated = any(s.role == "prefill" for s in steps)
    terms = {}
    for role in ("prefill", "decode"):
        kind = role if disaggregated else "aggregated"
        rows = [(s, it, price(coef, s.shape), rate.at(s.t), busy.over(s.process, s.t, s.t + s.busy_s))
                for s, it in iterations(steps) if s.role == role]
        rows = [row for row in rows if row[2] > 0]
        if len(rows) < 10:
            continue
        engine = _fit_engine(rows)
        fixed, per_sampled = nnls([[1.0, float(s.shape.num_sampled)] for s, *_ in rows],
                                  [it - s.engine_s for s, it, *_ in rows])  # the loop's own time, as measured
        t = dataclasses.replace(engine, fixed_s=fixed, per_sampled_s=per_sampled)
        predicted = [t.iteration_s(p, s.shape.num_sampled, r, o) for s, _, p, r, o in rows]
        error = statistics.fmean(abs(q - it) / it for q, (_, it, *_) in zip(predicted, rows))
        runs: dict[str, list[tuple[float, float, float]]] = {}
        for q, (s, it, *_) in zip(predicted, rows):
            runs.setdefault(s.process, []).append((s.t, it, q))
        noise_sd, noise_s = fit_noise([sorted(run) for run in runs.values()])
        terms[kind] = dataclasses.replace(t, noise_sd=noise_sd, noise_s=noise_s, steps=len(rows), error=error)
    return terms


def _fit_engine(rows: list[tuple[LoggedStep, float, float, float, float]]) -> LoopTerms:
    """The engine terms of one kind from (step, iteration s, price, token rate, others busy):
    the contention terms with one level per LEVEL_WINDOW_S of the log (the host's drift, which
    the terms must not soak up: fitted with one level, a run whose host slowed while its rate
    rose gave its prefill worker +0.06 per 100 streamed tokens/s, with a level per minute
    0.003), then `scale` as the one level of the whole log given them."""
    t0 = min(s.t for s, *_ in rows)
    windows = int((max(s.t for s, *_ in rows) - t0) // LEVEL_WINDOW_S) + 1
    matrix, target = [], []
    for s, _, p, r, o in rows:  # weighted: each row over the root of its step's time
        w = 1.0 / math.sqrt(s.engine_s)
        level = [0.0] * windows
        level[int((s.t - t0) // LEVEL_WINDOW_S)] = p * w
        matrix.append(level + [p * r * w, p * o * w, min(s.shape.num_sampled, SATURATED_ROWS) * w])
        target.append(s.engine_s * w)
    per_rate, per_busy, per_row = nnls(matrix, target)[windows:]
    terms = LoopTerms(1.0, 0.0, 0.0, per_rate, per_busy, per_row)
    return dataclasses.replace(terms, scale=level_of(terms, [(s, p, r, o) for s, _, p, r, o in rows]))


def level_of(terms: LoopTerms, rows: list[tuple[LoggedStep, float, float, float]]) -> float:
    """The `scale` that fits the engine times of (step, price, token rate, others busy) best
    given the other terms (weighted least squares as the fit's): the host's level over them."""
    num = den = 0.0
    for s, p, r, o in rows:
        rest = s.engine_s - (terms.engine_s(p, s.shape.num_sampled, r, o) - terms.scale * p)
        num, den = num + p * rest / s.engine_s, den + p * p / s.engine_s
    return max(0.0, num / den) if den > 0 else terms.scale


def levels(coef: list[float], loop_terms: dict[str, list[float]], steps: list[LoggedStep], start: float,
           end: float) -> dict[str, float]:
    """The host's level over [start, end) of a deployment's step log: each kind's `scale`
    (level_of) on the steps that began then, the other terms as `loop_terms` has them. Where
    the profile's terms were fitted an hour earlier, this is what the same steps cost now."""
    rate, busy = TokenRate(steps), OthersBusy(steps)
    disaggregated = any(s.role == "prefill" for s in steps)
    out = {}
    for role in ("prefill", "decode"):
        kind = role if disaggregated else "aggregated"
        if kind not in loop_terms:
            continue
        rows = [(s, p, rate.at(s.t), busy.over(s.process, s.t, s.t + s.busy_s)) for s in steps
                if s.role == role and start <= s.t < end for p in [price(coef, s.shape)] if p > 0]
        if rows:
            out[kind] = level_of(LoopTerms.of(loop_terms[kind]), rows)
    return out


def describe(terms: dict[str, LoopTerms]) -> str:
    return "; ".join(f"{kind}: steps x({t.scale:.2f} + {t.per_busy:.2f} with the other workers busy + "
                     f"{t.per_token_rate * 100:.3f} per 100 streamed tokens/s) the profile "
                     f"+{t.per_row_s * 1e3:.2f} ms per sampled row, +{t.fixed_s * 1e3:.1f} ms per iteration "
                     f"+{t.per_sampled_s * 1e3:.2f} ms per sampled row outside the engine "
                     f"({t.steps} steps, {t.error:.1%} mean error; runs of steps stray by a factor of "
                     f"e^N(0, {t.noise_sd:.2f}^2) lasting ~{t.noise_s:.1f} s)"
                     for kind, t in terms.items())
