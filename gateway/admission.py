"""Load shedding: refuse at once what would miss the TTFT bound anyway.

    ticket = admission.admit(prompt_tokens, kv_room=router.kv_room(prompt_tokens))  # or APIError 429
    ...
    admission.first_token(ticket, ttft_s)   # or first_token(ticket, None): it failed before

Predicted TTFT = base + (prompt tokens admitted and still waiting for their first token +
this prompt) / rate. Both are learnt from the system's own first tokens: `base` is the
fixed latency, a typical prompt's own prefill included (the fastest recent TTFT of a
request that found nothing queued), and each first token of a request that queued gives a
rate sample: the prompt tokens that were ahead of it / (TTFT - base), averaged
exponentially. Counting the tokens ahead matters: a request's own prompt over its TTFT is
far below the prefill rate whenever it queued, which would shed a loaded system that is
keeping up. Samples that are mostly fixed latency say little about the rate and are skipped.

A request is refused when its prediction is over `headroom` (75%) of the bound, so that the
prediction's error stays inside the bound. With nothing queued a request is always admitted
(an idle system has nothing to shed for), and a prompt no decode worker has KV room for is
refused: it would wait for running requests to finish.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gateway.errors import APIError

_ALPHA = 0.2  # weight of the newest rate sample
_BASE_WINDOW = 32  # unqueued first tokens the fixed latency is the minimum of
_MIN_QUEUED_SHARE = 0.3  # a rate sample needs at least this share of its TTFT beyond `base`


@dataclass(frozen=True)
class Ticket:
    """One admitted request, as admission counts it until its first token."""

    prompt_tokens: int
    ahead: int  # prompt tokens admitted earlier and still waiting for their first token


class Admission:
    def __init__(self, max_ttft_s: float | None, initial_rate_tokens_s: float = 1000.0, headroom: float = 0.75):
        self.max_ttft_s = max_ttft_s
        self.headroom = headroom
        self.rate = initial_rate_tokens_s  # prompt tokens per second from admission to first token
        self.queued_tokens = 0  # prompt tokens admitted here whose first token has not come back
        self._unqueued_ttfts: deque[float] = deque(maxlen=_BASE_WINDOW)

    @property
    def base_s(self) -> float:
        return min(self._unqueued_ttfts, default=0.0)

    def predicted_ttft(self, prompt_tokens: int) -> float:
        return self.base_s + (self.queued_tokens + prompt_tokens) / self.rate

    def admit(self, prompt_tokens: int, kv_room: bool = True) -> Ticket:
        if not kv_room:
            raise APIError(429, f"overloaded: no decode worker has KV cache room for {prompt_tokens} prompt tokens "
                                "now; retry later", code="overloaded", headers={"Retry-After": "1"})
        if self.max_ttft_s is not None and self.queued_tokens > 0:  # nothing waiting: nothing to shed for
            predicted = self.predicted_ttft(prompt_tokens)
            if predicted > self.headroom * self.max_ttft_s:
                wait = max(1, math.ceil(predicted - self.headroom * self.max_ttft_s))
                raise APIError(429, f"overloaded: predicted time to first token {predicted:.1f}s is too close to "
                                    f"the {self.max_ttft_s:.1f}s bound; retry later", code="overloaded",
                               headers={"Retry-After": str(wait)})
        ticket = Ticket(prompt_tokens, self.queued_tokens)
        self.queued_tokens += prompt_tokens
        return ticket

    def first_token(self, ticket: Ticket, ttft_s: float | None) -> None:
        """The request got its first token after `ttft_s`, or failed before it (None)."""
        self.queued_tokens -= ticket.prompt_tokens
        if ttft_s is None or ttft_s <= 0:
            return
        if ticket.ahead == 0:
            self._unqueued_ttfts.append(ttft_s)
            return
        queued_s = ttft_s - self.base_s
        if queued_s > _MIN_QUEUED_SHARE * ttft_s:
            self.rate = (1 - _ALPHA) * self.rate + _ALPHA * (ticket.ahead / queued_s)
