"""How long each tensor-parallel rank spends on its steps, and how much of that inside the
group's collectives, so a rank that holds the others back can be named.

Every rank adds its own forward passes (the model and the LM head: the part every rank
runs, sampling and step preparation left out) to a shared-memory table that rank 0 reads
at any time, without a message: steps, seconds, seconds inside collectives. In a
collective the ranks that arrive first wait for the last, so a straggler shows as the rank
that waits least and computes longest: `compute = step - collective`, per step.

On CPU (gloo) a collective returns when it is done, so its wall time is its wait and its
transfer. On CUDA (NCCL) a collective returns once queued: the host times then say how
long each rank took to queue its step, not the device's wait, which would need CUDA
events around each collective (not written: no GPU run has measured them).
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TypeVar

from common import envs

T = TypeVar("T")

_FIELDS = 3  # steps, step seconds, collective seconds

STRAGGLER_RATIO = 1.25  # compute per step this many times the others' median is slower
STRAGGLER_MIN_STEPS = 20  # fewer steps in a window judge nothing
STRAGGLER_MIN_GAP_S = 0.0005  # nor does a gap below this per step (timer noise at small steps)
STRAGGLER_WINDOWS = 3  # windows in a row naming the same rank before it is called consistently slower


class CollectiveTimer:
    """Seconds this rank spent inside collectives (its sharded layers add to it)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


@dataclass(frozen=True)
class RankTime:
    """One rank's totals since its group started, or over a window (`since`)."""

    rank: int
    steps: int
    step_s: float
    collective_s: float

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.collective_s)

    def since(self, earlier: RankTime) -> RankTime:
        return RankTime(self.rank, self.steps - earlier.steps, self.step_s - earlier.step_s,
                        self.collective_s - earlier.collective_s)


def injected_stretch(rank: int) -> float:
    """The factor envs.fault_slow_rank sets for `rank` (1: none)."""
    slow = envs.fault_slow_rank()
    return slow[1] if slow is not None and slow[0] == rank else 1.0


class RankClocks:
    """The table, one row per rank. Made by rank 0 and handed to each follower at its
    start (a shared-memory array pickles into a spawned process's arguments)."""

    def __init__(self, size: int):
        self.size = size
        self._table = multiprocessing.get_context("spawn").RawArray("d", size * _FIELDS)

    def record(self, rank: int, step_s: float, collective_s: float) -> None:
        """One forward pass of `rank` (its own row: no other process writes it)."""
        row = rank * _FIELDS
        self._table[row] += 1
        self._table[row + 1] += step_s
        self._table[row + 2] += collective_s

    def timed(self, rank: int, timer: CollectiveTimer, forward: Callable[[], T], stretch: float = 1.0) -> T:
        """forward(), its time and its time in collectives (per `timer`) added to `rank`'s
        row; `stretch` > 1 (injected: envs.fault_slow_rank) sleeps its compute to that many
        times what it took, as a slower device would."""
        collective0, t0 = timer.seconds, perf_counter()
        out = forward()
        if stretch > 1:
            time.sleep((stretch - 1) * max(0.0, perf_counter() - t0 - (timer.seconds - collective0)))
        self.record(rank, perf_counter() - t0, timer.seconds - collective0)
        return out

    def read(self) -> list[RankTime]:
        t = self._table[:]
        return [RankTime(r, int(t[r * _FIELDS]), t[r * _FIELDS + 1], t[r * _FIELDS + 2]) for r in range(self.size)]


def straggler(window: list[RankTime]) -> str:
    """The rank that held the group back over `window` (each rank's times since the last
    look), as a sentence for a health answer; "" when none did: every rank's compute per
    step is within STRAGGLER_RATIO of the median of the others', or too few steps ran."""
    found = _straggler(window)
    return found[1] if found else ""


def _straggler(window: list[RankTime]) -> tuple[int, str] | None:
    """(rank, sentence) of `straggler`, or None."""
    if len(window) < 2 or min(t.steps for t in window) < STRAGGLER_MIN_STEPS:
        return None
    per_step = {t.rank: t.compute_s / t.steps for t in window}
    waits = {t.rank: t.collective_s / t.steps for t in window}
    slowest = max(per_step, key=per_step.get)
    others = statistics.median(v for r, v in per_step.items() if r != slowest)
    if per_step[slowest] < STRAGGLER_RATIO * others or per_step[slowest] - others < STRAGGLER_MIN_GAP_S \
            or others <= 0:
        return None
    return slowest, (f"rank {slowest} computes {per_step[slowest] * 1e3:.1f} ms a step against the others' "
            f"{others * 1e3:.1f} ms ({per_step[slowest] / others:.1f}x), waiting {waits[slowest] * 1e3:.1f} ms in "
            f"collectives while they wait {statistics.median(w for r, w in waits.items() if r != slowest) * 1e3:.1f} "
            f"ms, over {min(t.steps for t in window)} steps")


class StragglerWatch:
    """Looks at a group's clocks now and then (each deep health check) and names a rank
    only once it was the straggler in STRAGGLER_WINDOWS windows in a row, so one slow step
    (a page fault, a neighbour's burst) names nobody. A window is what ran since the last
    window ended, and it ends only once it holds STRAGGLER_MIN_STEPS steps: a look before
    that reads the verdict and leaves the window growing. So however many callers look (each
    gateway process, the controller, a drain) and however slow the steps, the windows are
    whole; a window with no straggler breaks a run. Thread-safe (health checks come on gRPC
    threads)."""

    def __init__(self, clocks: RankClocks, windows: int = STRAGGLER_WINDOWS):
        self.clocks = clocks
        self.windows = windows
        self._last = clocks.read()
        self._rank: int | None = None
        self._run = 0
        self._lock = threading.Lock()
        self.verdict = ""  # the last named straggler's sentence, "" when none

    def look(self) -> str:
        with self._lock:
            now = self.clocks.read()
            window = [t.since(before) for t, before in zip(now, self._last)]
            if min(t.steps for t in window) < STRAGGLER_MIN_STEPS:
                return self.verdict  # the window goes on: too few steps to judge yet
            self._last = now
            return self._judge(window)

    def _judge(self, window: list[RankTime]) -> str:
        found = _straggler(window)
        rank, said = found if found else (None, "")
        self._run = self._run + 1 if rank is not None and rank == self._rank else int(rank is not None)
        self._rank = rank
        self.verdict = f"{said}, in {self._run} windows in a row" if self._run >= self.windows else ""
        return self.verdict
