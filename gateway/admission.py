"""Load shedding: refuse at once what would miss the TTFT bound anyway.

    ticket = admission.admit(prompt_tokens, kv_room=router.kv_room(prompt_tokens))  # or APIError 429
    ...
    admission.first_token(ticket)   # its first token came, or it failed before one

The prediction is Little's law: a new request waits for what is queued ahead of it (admitted
here, no first token yet) over the rate at which queued work gets its first tokens. The rate
is measured, not modelled: the last `window` first tokens over the *busy* time they took
(time with something queued that is younger than the bound), so idle time does not dilute
it, and a request that is stuck does not either: the rate is frozen while nothing
completes, and a request queued longer than the bound no longer counts as work going on, so
one stuck request (a stuck transfer, a wedged worker) does not shed everyone else.
Whatever the bottleneck is (prefill compute, per-request overheads, a decode pool short of
CPU) is in it. Two waits are predicted, and
the larger is used: in requests, (queued + itself) / requests per second, and in prompt
tokens, the tokens queued ahead / tokens per second. Short prompts cost mostly per request,
long ones per token; a long prompt's own prefill is not held against it (nothing queued:
it is admitted, however long). Until `window` first tokens have been seen, prior rates
stand in for the missing ones. The priors are measured too: the prompt tokens per second
the workers report computing (their Stats, read each health round; `observe_capacity`),
and in requests, that rate over the mean prompt admitted so far (at least
`MIN_TOKENS_PER_REQUEST`: a request's fixed costs, in the same measured units). So a slow
host starts from its own speed, not from another host's; the fixed priors below are used
only before any worker has reported.

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


MIN_TOKENS_PER_REQUEST = 128  # a request costs at least this much prefill work, in prompt tokens


@dataclass(eq=False)
class Ticket:
    """One admitted request, as admission counts it until its first token."""

    prompt_tokens: int
    admitted_at: float


class Admission:
    def __init__(self, max_ttft_s: float | None, headroom: float = 0.75, window: int = 32,
                 prior_requests_s: float = 4.0, prior_tokens_s: float = 2000.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_ttft_s = max_ttft_s
        self.headroom = headroom
        self.window = window
        self.prior = (prior_requests_s, prior_tokens_s)
        self._measured_tokens_s: float | None = None  # what the workers report (observe_capacity)
        self._admitted = (0, 0)  # requests admitted and their prompt tokens: the mean prompt
        self.clock = clock
        self._queued: set[Ticket] = set()  # admitted here, no first token yet
        self.queued_tokens = 0  # their prompt tokens
        self._stale_s = max_ttft_s if max_ttft_s is not None else 60.0  # queued longer: stuck, not busy
        self._busy_s = 0.0  # seconds with something queued, in all
        self._since = clock()  # when _busy_s was last brought up to date
        # busy clock at each of the last `window` first tokens (and the one before them), and tokens
        self._done: deque[tuple[float, int]] = deque([(0.0, 0)], maxlen=window + 1)

    @property
    def queued_requests(self) -> int:
        return len(self._queued)

    def observe_capacity(self, prompt_tokens_s: float) -> None:
        """The prompt tokens per second the serving workers measured themselves computing
        (summed over the pool that prefills); 0 or less: not known yet."""
        self._measured_tokens_s = prompt_tokens_s if prompt_tokens_s > 0 else None

    def priors(self) -> tuple[float, float]:
        """The rates assumed for first tokens not seen yet: measured where the workers have
        reported, else the fixed ones."""
        if self._measured_tokens_s is None:
            return self.prior
        n, tokens = self._admitted
        per_request = max(MIN_TOKENS_PER_REQUEST, tokens / n if n else 0.0)
        return self._measured_tokens_s / per_request, self._measured_tokens_s

    def rates(self) -> tuple[float, float]:
        """First tokens per busy second over the last `window` of them, in requests and in
        prompt tokens; prior rates fill in for the ones not seen yet."""
        n = len(self._done) - 1
        span = self._done[-1][0] - self._done[0][0]
        prior_requests_s, prior_tokens_s = self.priors()
        missing_s = (self.window - n) / prior_requests_s  # the time the missing ones would have taken
        tokens = sum(t for _, t in list(self._done)[1:]) + (self.window - n) * prior_tokens_s / prior_requests_s
        seconds = span + missing_s
        return (self.window / seconds, tokens / seconds) if seconds > 0 else (math.inf, math.inf)

    def drain_s(self) -> float:
        """Seconds until what is queued now has its first tokens, at the measured rates (0
        with nothing queued): when a refused client may find room (its Retry-After)."""
        if not self._queued:
            return 0.0
        requests_s, tokens_s = self.rates()
        return max(self.queued_requests / requests_s, self.queued_tokens / tokens_s)

    def predicted_ttft(self, prompt_tokens: int) -> float:
        requests_s, tokens_s = self.rates()
        return max((self.queued_requests + 1) / requests_s, self.queued_tokens / tokens_s)

    def check(self) -> None:
        """429 now if a request would be shed whatever its prompt (the wait predicted for it
        is for what is queued ahead): called before its prompt is tokenized, so an overload
        costs the gateway no tokenization of requests it refuses anyway."""
        self._shed_if_late()

    def admit(self, prompt_tokens: int, kv_room: bool = True) -> Ticket:
        if not kv_room:
            raise APIError(429, f"overloaded: no decode worker has KV cache room for {prompt_tokens} prompt tokens "
                                "now; retry later", code="overloaded", headers={"Retry-After": "1"},
                           reason="kv_headroom")
        self._shed_if_late()
        ticket = Ticket(prompt_tokens, self._tick())
        self._admitted = (self._admitted[0] + 1, self._admitted[1] + prompt_tokens)
        self._queued.add(ticket)
        self.queued_tokens += prompt_tokens
        return ticket

    def _shed_if_late(self) -> None:
        if self.max_ttft_s is not None and self.queued_requests > 0:  # nothing waiting: nothing to shed for
            predicted = self.predicted_ttft(0)
            if predicted > self.headroom * self.max_ttft_s:
                wait = max(1, math.ceil(predicted - self.headroom * self.max_ttft_s))
                raise APIError(429, f"overloaded: predicted time to first token {predicted:.1f}s is too close to "
                                    f"the {self.max_ttft_s:.1f}s bound; retry later", code="overloaded",
                               headers={"Retry-After": str(wait)}, reason="predicted_ttft")

    def first_token(self, ticket: Ticket, served: bool = True) -> None:
        """The request got its first token (`served`), or failed before one: it waits no more.
        A ticket counts once; a second call is ignored."""
        if ticket not in self._queued:
            return
        self._tick()
        self._queued.remove(ticket)
        self.queued_tokens -= ticket.prompt_tokens
        if served:
            self._done.append((self._busy_s, ticket.prompt_tokens))

    def _tick(self) -> float:
        """Bring the busy clock up to now: time counts while a queued request is younger
        than the bound. Returns now."""
        now = self.clock()
        if self._queued:
            fresh_until = max(t.admitted_at for t in self._queued) + self._stale_s
            self._busy_s += max(0.0, min(now, fresh_until) - self._since)
        self._since = now
        return now
