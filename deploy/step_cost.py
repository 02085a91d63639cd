"""What one engine step costs, fitted on steps the real runner ran.

A step's time is mostly the linears (a function of the tokens it runs, M: bound by the
weights' bandwidth at small M, by compute at large M, with a bend between that no single
line fits), plus attention (decodes read their whole contexts; a prefill chunk of n new
tokens after s cached ones does ~n * (s + n/2) query-key work) and the LM head on the rows
that sample. So the model is

    step(shape) = f(M) + a * sum(decode contexts) + b * sum(n * (s + n/2)) + c * chunks + d * sampled rows

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

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
NAMES = [f"linears@{k}" for k in KNOTS] + ["decode_context", "prefill_attention", "prefill_chunks", "sampled_rows"]


def _hats(m: float) -> list[float]:
    """Weights of the knots for m tokens: linear interpolation between the two around it."""
    out = [0.0] * len(KNOTS)
    if m <= KNOTS[0]:
        out[0] = 1.0
        return out
    for i in range(1, len(KNOTS)):
        if m <= KNOTS[i] or i == len(KNOTS) - 1:  # past the last knot: the last segment, extended
            t = (m - KNOTS[i - 1]) / (KNOTS[i] - KNOTS[i - 1])
            out[i - 1], out[i] = 1.0 - t, t
            return out
    return out


def features(shape) -> list[float]:
    """The model's inputs for a StepShape (deploy.sim_worker)."""
    chunks = shape.prefill_chunks
    return [*_hats(shape.num_tokens), float(sum(shape.decode_contexts)),
            float(sum(n * (s + n / 2) for s, n in chunks)), float(len(chunks)), float(shape.num_sampled)]


def price(coef: list[float], shape) -> float:
    """A StepShape's seconds under coefficients in NAMES order."""
    return sum(c * f for c, f in zip(coef, features(shape)))


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
            from deploy.simulator import percentile  # (the simulator imports the profile, which imports this)

            errors = [abs(model.seconds(s) - t) / t for s, t in test]
            model.held_out_error = statistics.fmean(errors)
            model.held_out_p90_error = percentile(errors, 90)
        model.coef = _fit(points)
        return model


def _fit(points: list[tuple[object, float]]) -> list[float]:
    rows = [[f / t for f in features(s)] for s, t in points]  # relative error: each row over its time
    return nnls(rows, [1.0] * len(points))
