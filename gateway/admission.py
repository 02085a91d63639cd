"""Load shedding: refuse at once what would miss the TTFT bound anyway.

    ticket = admission.admit(prompt_tokens, kv_room=router.kv_room(prompt_tokens))  # or APIError 429
    ...
    admission.first_token(ticket)   # its first token came, or it failed before one

The prediction is Little's law: a new request waits for what is queued ahead of it (admitted
here, no first token yet) and itself, over the rate at which queued work gets its first
tokens. The rate is measured, not modelled: first tokens per second of *busy* time (time
with something queued) over the last `window_s` of it, so idle time does not dilute it and
whatever the bottleneck is (prefill compute, per-request overheads, a decode pool short of
CPU) is in it. Both requests and prompt tokens are counted, and the larger of the two
predictions is used: short prompts cost mostly per request, long ones per token. Until a
window of busy time has been seen, prior rates fill the unobserved part of it.

A request is refused when its prediction is over `headroom` (75%) of the bound, so that the
prediction's error stays inside the bound. With nothing queued a request is always admitted
(an idle system has nothing to shed for), and a prompt no decode worker has KV room for is
refused: it would wait for running requests to finish. A measured rate is below capacity
until the system is saturated, so a burst after a quiet spell meets early 429s until its
own first tokens show the real rate: the error is on the side of the bound.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import APIError


@dataclass(frozen=True)
class Ticket:
    """One admitted request, as admission counts it until its first token."""

    prompt_tokens: int


class Admission:
    def __init__(self, max_ttft_s: float | None, headroom: float = 0.75, window_s: float = 10.0,
                 prior_requests_s: float = 4.0, prior_tokens_s: float = 2000.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_ttft_s = max_ttft_s
        self.headroom = headroom
        self.window_s = window_s
        self.prior = (prior_requests_s, prior_tokens_s)
        self.clock = clock
        self.queued_requests = 0  # admitted here, no first token yet
        self.queued_tokens = 0  # their prompt tokens
        self._busy_s = 0.0  # seconds with something queued, in all
        self._since = clock()  # when _busy_s was last brought up to date
        self._done: deque[tuple[float, int]] = deque()  # (busy clock, prompt tokens) of recent first tokens

    def rates(self) -> tuple[float, float]:
        """First tokens per busy second, in requests and in prompt tokens."""
        busy = self._tick()
        while self._done and self._done[0][0] < busy - self.window_s:
            self._done.popleft()
        unobserved = max(0.0, self.window_s - busy)  # early on, the priors fill the rest of the window
        requests = (len(self._done) + self.prior[0] * unobserved) / self.window_s
        tokens = (sum(t for _, t in self._done) + self.prior[1] * unobserved) / self.window_s
        return requests, tokens

    def predicted_ttft(self, prompt_tokens: int) -> float:
        requests_s, tokens_s = self.rates()
        by_requests = (self.queued_requests + 1) / requests_s if requests_s > 0 else math.inf
        by_tokens = (self.queued_tokens + prompt_tokens) / tokens_s if tokens_s > 0 else math.inf
        return max(by_requests, by_tokens)

    def admit(self, prompt_tokens: int, kv_room: bool = True) -> Ticket:
        if not kv_room:
            raise APIError(429, f"overloaded: no decode worker has KV cache room for {prompt_tokens} prompt tokens "
                                "now; retry later", code="overloaded", headers={"Retry-After": "1"})
        if self.max_ttft_s is not None and self.queued_requests > 0:  # nothing waiting: nothing to shed for
            predicted = self.predicted_ttft(prompt_tokens)
            if predicted > self.headroom * self.max_ttft_s:
                wait = 1 if math.isinf(predicted) else max(1, math.ceil(predicted - self.headroom * self.max_ttft_s))
                raise APIError(429, f"overloaded: predicted time to first token {predicted:.1f}s is too close to "
                                    f"the {self.max_ttft_s:.1f}s bound; retry later", code="overloaded",
                               headers={"Retry-After": str(wait)})
        self._tick()
        self.queued_requests += 1
        self.queued_tokens += prompt_tokens
        return Ticket(prompt_tokens)

    def first_token(self, ticket: Ticket, served: bool = True) -> None:
        """The request got its first token (`served`), or failed before one: it waits no more."""
        busy = self._tick()
        self.queued_requests -= 1
        self.queued_tokens -= ticket.prompt_tokens
        if served:
            self._done.append((busy, ticket.prompt_tokens))

    def _tick(self) -> float:
        now = self.clock()
        if self.queued_requests > 0:
            self._busy_s += now - self._since
        self._since = now
        return self._busy_s
