"""What a prefix fetch is predicted to cost, from the fetches this worker measured: a fixed
part (the holder takes the pull between its engine steps, a round trip, the notification)
and a part per block (the bytes), fitted by least squares over the last `window` fetches,
against computing the same tokens at the worker's measured prefill rate.

A fetch predicted slower is skipped, but one in `probe_every` is made anyway: a skipped fetch
measures nothing, and without probes one slow fetch from a busy holder would turn fetching
off for good, the large fetches that would save the most included.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW = 32
DEFAULT_PROBE_EVERY = 8


class FetchCost:
    def __init__(self, window: int = DEFAULT_WINDOW, probe_every: int = DEFAULT_PROBE_EVERY):
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)  # (blocks, seconds)
        self.probe_every = probe_every
        self._skipped = 0

    def observe(self, blocks: int, seconds: float) -> None:
        """A fetch of `blocks` blocks that completed in `seconds`."""
        if blocks > 0:
            self._samples.append((blocks, seconds))

    def predict_s(self, blocks: int) -> float | None:
        """Seconds a fetch of `blocks` blocks should take (None: nothing measured yet)."""
        if not self._samples:
            return None
        n = len(self._samples)
        mean_b = sum(b for b, _ in self._samples) / n
        mean_s = sum(s for _, s in self._samples) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in self._samples)
        if var_b == 0:  # one size seen: its time is all we know, scaled as a rate
            return mean_s * blocks / mean_b
        per_block = max(0.0, sum((b - mean_b) * (s - mean_s) for b, s in self._samples) / var_b)
        fixed = max(0.0, mean_s - per_block * mean_b)
        return fixed + per_block * blocks

    def worth_it(self, blocks: int, compute_s: float | None) -> bool:
        """Fetch `blocks` blocks rather than compute them in `compute_s` (None: the prefill
        rate is not measured yet)? True while either side is unmeasured, when predicted
        cheaper, and for one skipped fetch in `probe_every`."""
        predicted = self.predict_s(blocks)
        if predicted is None or compute_s is None or predicted < compute_s:
            return True
        self._skipped += 1
        return self._skipped % self.probe_every == 0
