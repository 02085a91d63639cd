"""What one engine step costs, fitted on steps the real runner ran.

A step's time is mostly the linears (a function of the tokens it runs, M: bound by the
weights' bandwidth at small M, by compute at large M, with a bend between that no single
line fits), plus attention (decodes read their whole contexts; a prefill chunk of n new
tokens after s cached ones does ~n * (s + n/2) query-key work), each sequence's own work
(a decode row is one sequence: its attention call and block table; a chunk is one for all its
tokens) and the LM head on the rows that sample. So the model is

    step(shape) = f(M) + a * sum(decode contexts) + b * sum(n * (s + n/2)) + c * chunks + d * sampled rows
                  + e * decode rows

Without the last term a decode batch of B prices f(B) with its B sequences' own work in it,
and a prompt's chunk of B tokens inherits that price: served chunks of 32-127 tokens ran
~20% under it (bench/RESULTS.md).

with f piecewise linear in M between knots (hat functions, extrapolated past the last
one), all coefficients non-negative, fitted by least squares on relative error (a 5 ms
step and a 300 ms one count alike). The features come from `StepShape` (sim_worker.py),
which reads a schedule the way the runner batches it; `pdserve profile` measures the
points on mixed workloads and reports the error on steps held out of the fit.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from deploy.planner.slo import percentile

# Every batch size up to 16, then sparser: the linears' cost is not smooth in M at decode
# batch sizes (a CPU GEMM blocks rows by its vector width: on an AVX-512 host batch 8 decodes
# faster than batch 6 or 7), and decodes spend most of a deployment's time there.
KNOTS = (*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 96, 128, 192, 256, 384, 512)
LEGACY_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # what profiles made before the dense knots fitted
TERMS = ["decode_context", "prefill_attention", "prefill_chunks", "sampled_rows", "decode_rows"]
NAMES = [f"linears@{k}" for k in KNOTS] + TERMS


def _hats(m: float, knots: tuple[int, ...]) -> list[float]:
    """Weights of the knots for m tokens: linear interpolation between the two around it."""
    out = [0.0] * len(knots)
    if m <= knots[0]:
        out[0] = 1.0
        return out
    for i in range(1, len(knots)):
        if m <= knots[i] or i == len(knots) - 1:  # past the last knot: the last segment, extended
            t = (m - knots[i - 1]) / (knots[i] - knots[i - 1])
            out[i - 1], out[i] = 1.0 - t, t
            return out
    return out


def features(shape, knots: tuple[int, ...] = KNOTS) -> list[float]:
    """The model's inputs for a StepShape (deploy.planner.sim_worker)."""
    chunks = shape.prefill_chunks
    return [*_hats(shape.num_tokens, knots), float(sum(shape.decode_contexts)),
            float(sum(n * (s + n / 2) for s, n in chunks)), float(len(chunks)), float(shape.num_sampled),
            float(len(shape.decode_contexts))]


def knots_of(coef: list[float]) -> tuple[int, ...]:
    """The knots a coefficient list was fitted with (a profile older than the dense knots
    has the legacy ones)."""
    return LEGACY_KNOTS if len(coef) < len(KNOTS) else KNOTS


def price(coef: list[float], shape) -> float:
    """A StepShape's seconds under coefficients in NAMES order (or the legacy knots'). A
    profile made before a term was added has fewer coefficients: the terms it lacks are 0."""
    return sum(c * f for c, f in zip(coef, features(shape, knots_of(coef))))


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """min ||A x - y|| with x >= 0 (Lawson and Hanson's active set method)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = np.where(~passive & (w > 1e-12 * max(1.0, float(np.abs(w).max()))))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(w[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return [float(v) for v in x]


@dataclass
class StepCost:
    """The fitted model (coefficients in NAMES order) and its error on held-out steps."""

    coef: list[float] = field(default_factory=lambda: [0.0] * len(NAMES))
    held_out_error: float = float("nan")  # mean |predicted - measured| / measured
    held_out_p90_error: float = float("nan")
    points: int = 0

    def seconds(self, shape) -> float:
        return price(self.coef, shape)

    @classmethod
    def fit(cls, points: list[tuple[object, float]], held_out: float = 0.2, seed: int = 0) -> StepCost:
        """Fit on (shape, seconds) points, `held_out` of them kept aside to measure the error,
        then refit on all of them."""
        shuffled = points[:]
        random.Random(seed).shuffle(shuffled)
        cut = int(len(shuffled) * (1 - held_out)) if len(shuffled) >= 10 else len(shuffled)
        train, test = shuffled[:cut], shuffled[cut:]
        model = cls(_fit(train), points=len(points))
        if test:
            errors = [abs(model.seconds(s) - t) / t for s, t in test]
            model.held_out_error = statistics.fmean(errors)
            model.held_out_p90_error = percentile(errors, 90)
        model.coef = _fit(points)
        return model


def _fit(points: list[tuple[object, float]]) -> list[float]:
    """Coefficients in NAMES order. A knot with less than one point's weight on it is not fitted
    (one stray point would set it alone): its value is the interpolation between the nearest
    fitted knots, and its points' weight is theirs in the fit, in the same proportions."""
    feats = [features(s) for s, _ in points]
    k = len(KNOTS)
    anchors = [j for j in range(k) if sum(f[j] for f in feats) >= 1.0] or list(range(k))
    spread = [_between(j, anchors) for j in range(k)]  # knot -> [(anchor, weight)]
    columns = anchors + list(range(k, len(NAMES)))
    rows = []
    for f, (_, t) in zip(feats, points):  # relative error: each row over its time
        row = dict.fromkeys(columns, 0.0)
        for j in range(k):
            for a, w in spread[j]:
                row[a] += f[j] * w
        for j in range(k, len(NAMES)):
            row[j] = f[j]
        rows.append([row[j] / t for j in columns])
    fitted = dict(zip(columns, nnls(rows, [1.0] * len(points))))
    # (a knot past the last fitted one, on a falling line extended, would go below 0: it stops at 0)
    knots = [max(0.0, sum(fitted[a] * w for a, w in spread[j])) for j in range(k)]
    return knots + [fitted[j] for j in range(k, len(NAMES))]


def _between(j: int, anchors: list[int]) -> list[tuple[int, float]]:
    """Knot j as a linear blend of the anchor knots around it: itself, if it is one; past the
    last, the last two's line extended (as the hats extend the last segment); before the
    first, the first one."""
    if j in anchors:
        return [(j, 1.0)]
    lo = max((a for a in anchors if a < j), default=None)
    hi = min((a for a in anchors if a > j), default=None)
    if hi is None and len(anchors) >= 2:
        lo, hi = anchors[-2], anchors[-1]
    elif lo is None or hi is None:
        return [(lo if hi is None else hi, 1.0)]
    t = (KNOTS[j] - KNOTS[lo]) / (KNOTS[hi] - KNOTS[lo])
    return [(lo, 1.0 - t), (hi, t)]
