"""`--max-connections`: past it a request is answered a JSON 503 whose Retry-After is measured.

uvicorn's own limit (`limit_concurrency`) answers a plain-text 503 with no Retry-After, so
a client can only guess when to come back (and an aggressive one retries at once, adding to
the connections it is refused for). Here the limit is the gateway's: a request that arrives
while more than `limit` connections are open (this one among them), or `limit` requests are
being answered, gets the JSON error every other refusal has, and a Retry-After of the time
the connections over the limit take to close at the rate connections closed lately
(`ConnectionTurnover`): a slot frees when one closes, whatever held it.
"""

from __future__ import annotations

import json
import math
from collections import deque

from gateway.errors import error_body

# Closes older than this say nothing about when a slot frees now; with none that recent the
# wait is the soonest an idle connection is closed (KEEP_ALIVE_S, passed in).
WINDOW_S = 60.0
WINDOW_CLOSES = 64  # the rate is measured over at most this many of the latest closes


class ConnectionTurnover:
    """When the server's connections closed lately; `wait_s` is how long `excess` more take
    at that rate."""

    def __init__(self, idle_close_s: float):
        self.idle_close_s = idle_close_s  # with nothing measured: when an idle connection is closed
        self._closes: deque[float] = deque(maxlen=WINDOW_CLOSES)

    def closed(self, now: float) -> None:
        """A connection closed at `now` (the loop's clock)."""
        self._closes.append(now)

    def wait_s(self, excess: int, now: float) -> float:
        """Seconds until `excess` connections have closed at the rate measured over the latest
        closes (at most WINDOW_S): `excess` x the mean gap from the oldest of them to now."""
        while self._closes and now - self._closes[0] > WINDOW_S:
            self._closes.popleft()
        if not self._closes:
            return self.idle_close_s
        span = max(now - self._closes[0], 1e-3)
        return min(WINDOW_S, excess * span / len(self._closes))


def over_limit(limit: int, connections: int, requests: int) -> int:
    """How many connections are over `limit` (0: serve): `connections` open counting the
    asking one, `requests` being answered not counting it."""
    return max(connections - limit, requests + 1 - limit, 0)


def service_unavailable(limit: int, wait_s: float) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The JSON 503 of a gateway at its connection limit: (body, headers), Retry-After `wait_s`
    rounded up (at least 1 s)."""
    body = json.dumps(error_body(503, f"the gateway is serving its limit of {limit} connections "
                                      "(--max-connections): retry after the time in Retry-After",
                                 code="too_many_connections")).encode()
    wait = max(1, math.ceil(wait_s)) if math.isfinite(wait_s) else 1
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"retry-after", str(wait).encode()), (b"connection", b"close")]
