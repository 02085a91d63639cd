"""Load shedding: refuse at once what would miss the TTFT bound anyway.

Predicted TTFT = (prompt tokens admitted and still waiting for their first token + this
prompt) / the measured prefill rate; and a prompt that no decode worker has KV headroom for
would wait for running requests to finish, so it is refused too. The rate is learned from the system's own first
tokens (an exponential moving average of prompt tokens per second of TTFT), so a 429 takes
milliseconds instead of a client timing out after the queue finally reaches it. With nothing
queued, a request is always admitted: the rate learnt from short prompts underestimates the
prefill rate (TTFT carries fixed latency), which must not keep an idle system shedding.
"""

from __future__ import annotations

import math

from gateway.errors import APIError

_ALPHA = 0.2  # weight of the newest observation in the rate average


class Admission:
    def __init__(self, max_ttft_s: float | None, initial_rate_tokens_s: float = 1000.0):
        self.max_ttft_s = max_ttft_s
        self.rate = initial_rate_tokens_s
        self.queued_tokens = 0  # prompt tokens admitted here whose first token has not come back

    def predicted_ttft(self, prompt_tokens: int) -> float:
        return (self.queued_tokens + prompt_tokens) / self.rate

    def admit(self, prompt_tokens: int, kv_room: bool = True) -> None:
        if not kv_room:
            raise APIError(429, f"overloaded: no decode worker has KV cache room for {prompt_tokens} prompt tokens "
                                "now; retry later", code="overloaded", headers={"Retry-After": "1"})
        if self.max_ttft_s is not None and self.queued_tokens > 0:  # nothing waiting: nothing to shed for
            predicted = self.predicted_ttft(prompt_tokens)
            if predicted > self.max_ttft_s:
                wait = max(1, math.ceil(predicted - self.max_ttft_s))
                raise APIError(429, f"overloaded: predicted time to first token {predicted:.1f}s is over the "
                                    f"{self.max_ttft_s:.1f}s bound; retry later", code="overloaded",
                               headers={"Retry-After": str(wait)})
        self.queued_tokens += prompt_tokens

    def first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        """The request got its first token (or failed before it): it no longer waits for prefill."""
        self.queued_tokens -= prompt_tokens
        if ttft_s > 0.01 and prompt_tokens > 0:
            self.rate = (1 - _ALPHA) * self.rate + _ALPHA * (prompt_tokens / ttft_s)
