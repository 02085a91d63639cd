"""SLO maths, one definition each, for the planner, the simulator and the serving benchmark
alike: a "p90" or a goodput means the same statistic wherever it is printed.

- `percentile`: linear between the closest ranks (numpy's default, and what vLLM's
  benchmark_serving reports), so a measured `pdserve bench` p90 and a simulated one are
  the same statistic, and comparable with the peer systems' figures.
- `SLO.met`: a request is good if its first token came within the TTFT bound and its TPOT
  is within its bound (a one-token output has no TPOT to miss).
- `attainment`: good requests over all of them.
- `passes` / `goodput`: a load passes at TARGET_ATTAINMENT; goodput is the highest passing
  offered rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

TARGET_ATTAINMENT = 0.9  # a load "passes" at this share of good requests
QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Within both bounds; a first token that never came (None) misses, a TPOT of None
        (a one-token output) has nothing to miss."""
        return ttft_s is not None and ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None if empty."""
    s = sorted(values)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def attainment(good: int, total: int) -> float:
    """The share of `total` requests that were good (0 with none)."""
    return good / total if total else 0.0


def passes(share: float) -> bool:
    """Whether a load at this SLO attainment counts towards goodput."""
    return share >= TARGET_ATTAINMENT


def goodput(points: Iterable[tuple[float, float]]) -> float | None:
    """The highest offered rate among (rate, attainment) points that passes; None if none
    does (the points need not be monotone: a passing rate above a failing one counts)."""
    return max((rate for rate, share in points if passes(share)), default=None)
