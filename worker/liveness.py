"""Is this worker making progress? Liveness from completed steps, not from a probe's wait.

A worker is *wedged* when it has work and its engine loop completes no step for longer
than the stall bound; a worker that is stepping is alive however long its queue, and a
busy worker on a slow host is never punished for being slow. The bound is derived from
what this worker measured of its own speed:

    stall_bound = max(floor_s, factor * longest step seen)

where the longest step starts as the warm-up step (one full token budget, run before the
worker is ready) and then follows the last `window` steps. The floor (default 10 s,
`--stall-timeout` on the workers) keeps a fast host from calling a scheduling hiccup a
wedge. An idle worker has no steps to show, so its deep probe runs a real one-token
forward pass through the loop (a wedged idle loop never runs it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

DEFAULT_STALL_FLOOR_S = 10.0
STALL_FACTOR = 10.0  # a step this many times the longest one measured is no longer a slow step


@dataclass(frozen=True)
class Verdict:
    """One deep-health answer: alive or wedged, and the facts it was judged on."""

    ok: bool
    busy: bool  # had work (judged on its last step) rather than idle (judged on a probe)
    last_step_age_s: float  # since the loop last completed a step (or probe)
    stall_bound_s: float
    longest_step_s: float
    queued: int  # requests the engine has not finished
    detail: str = ""
    straggler: str = ""  # a tensor-parallel worker's rank holding its group back (engine/parallel/rank_clock.py)


class Liveness:
    """Written by the engine loop thread (`stepped`), read by gRPC threads (`bound_s`, `age_s`).

    Plain float and deque reads under a small lock: a reader may see one step late, never
    a torn value."""

    def __init__(self, floor_s: float = DEFAULT_STALL_FLOOR_S, factor: float = STALL_FACTOR, window: int = 256):
        if floor_s <= 0:
            raise ValueError(f"stall floor {floor_s}: must be > 0 seconds")
        self.floor_s = floor_s
        self.factor = factor
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self._prefill: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) of big steps
        self._warm_up_s = 0.0
        self._warm_up_tokens = 0
        self.last_progress = time.monotonic()

    def warmed_up(self, seconds: float, tokens: int) -> None:
        """The warm-up step (a full token budget): the longest step expected before any is
        seen, and the prefill rate until real prefill steps are seen."""
        with self._lock:
            self._warm_up_s, self._warm_up_tokens = seconds, tokens
            self.last_progress = time.monotonic()

    def stepped(self, seconds: float, tokens: int = 0) -> None:
        """The loop completed a step of `tokens` tokens that took `seconds`."""
        with self._lock:
            self._recent.append(seconds)
            if self._warm_up_tokens and tokens >= self._warm_up_tokens // 4:  # prefill-dominated
                self._prefill.append((tokens, seconds))
            self.last_progress = time.monotonic()

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second this worker computes, as measured: its recent
        prefill-dominated steps, else the warm-up step (0: nothing measured yet)."""
        with self._lock:
            tokens = sum(t for t, _ in self._prefill) or self._warm_up_tokens
            seconds = sum(s for _, s in self._prefill) or self._warm_up_s
        return tokens / seconds if seconds > 0 else 0.0

    def probed(self) -> None:
        """The loop ran a deep-health probe (a one-token pass: progress, but no step to learn from)."""
        with self._lock:
            self.last_progress = time.monotonic()

    @property
    def longest_step_s(self) -> float:
        with self._lock:
            return max(self._warm_up_s, max(self._recent, default=0.0))

    @property
    def bound_s(self) -> float:
        return max(self.floor_s, self.factor * self.longest_step_s)

    def age_s(self) -> float:
        return time.monotonic() - self.last_progress

    def judge_busy(self, queued: int) -> Verdict:
        """A worker with work: alive iff it completed a step within the bound."""
        age, bound, longest = self.age_s(), self.bound_s, self.longest_step_s
        ok = age <= bound
        detail = "" if ok else (f"wedged: {queued} requests queued and no step completed for {age:.1f}s "
                                f"(stall bound {bound:.1f}s, longest step {longest:.2f}s)")
        return Verdict(ok, True, age, bound, longest, queued, detail)

    def judge_idle(self, probed: bool, loop_age_s: float, error: str = "") -> Verdict:
        """An idle worker: alive iff its probe ran, or (probe not back before the caller's
        deadline) its loop iterated within the bound."""
        bound, longest = self.bound_s, self.longest_step_s
        if error:
            return Verdict(False, False, self.age_s(), bound, longest, 0, f"probe failed: {error}")
        ok = probed or loop_age_s <= bound
        detail = "" if ok else f"wedged: idle loop ran no iteration for {loop_age_s:.1f}s (stall bound {bound:.1f}s)"
        return Verdict(ok, False, self.age_s(), bound, longest, 0, detail)
