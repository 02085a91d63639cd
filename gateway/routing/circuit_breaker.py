"""A circuit breaker per decode worker: the gateway stops sending to one that keeps failing.

Closed, a worker takes requests; each that fails on it before its first message (it broke
the stream, refused it as down, or ended it with an error and no token: what costs the
request a retry elsewhere) counts, each that starts on it resets the count. After
`failures` in a row the breaker opens: routing skips the worker (as long as another can
serve) for `cool_down_s`, then lets one request through as a probe (half open). The probe
starting closes it; the probe failing opens it again for twice as long, up to `max_cool_down_s`.
The cool-down starts at the gateway's health interval, the time it takes to learn anything
new of a worker by asking; a worker that is merely slow never opens it (only failures count).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # one probe request allowed


class CircuitBreaker:
    def __init__(self, cool_down_s: float, failures: int = 5, max_cool_down_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.base_cool_down_s, self.failures, self.max_cool_down_s = cool_down_s, failures, max_cool_down_s
        self.clock = clock
        self.state = State.CLOSED
        self.failed_in_a_row = 0
        self.cool_down_s = cool_down_s
        self.reopens_at = 0.0
        self.opened = 0  # times it opened (from closed or from a failed probe)

    @property
    def open(self) -> bool:
        return self.state is not State.CLOSED

    def allows(self) -> bool:
        """Whether a request may go to the worker now: closed, or past the cool-down (a probe;
        a probe whose outcome never came, its client gone, is followed by another after one
        more cool-down)."""
        return self.state is State.CLOSED or self.clock() >= self.reopens_at

    def picked(self) -> None:
        """A request was sent to the worker: past an open breaker's cool-down it is the probe."""
        if self.state is not State.CLOSED and self.clock() >= self.reopens_at:
            self.state = State.HALF_OPEN
            self.reopens_at = self.clock() + self.cool_down_s

    def succeeded(self) -> None:
        self.state, self.failed_in_a_row, self.cool_down_s = State.CLOSED, 0, self.base_cool_down_s

    def failed(self) -> None:
        self.failed_in_a_row += 1
        if self.state is State.HALF_OPEN:
            self._open(min(self.max_cool_down_s, 2 * self.cool_down_s))
        elif self.state is State.CLOSED and self.failed_in_a_row >= self.failures:
            self._open(self.base_cool_down_s)

    def _open(self, cool_down_s: float) -> None:
        self.state, self.cool_down_s = State.OPEN, cool_down_s
        self.reopens_at = self.clock() + cool_down_s
        self.opened += 1
