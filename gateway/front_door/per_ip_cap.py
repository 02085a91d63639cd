"""How many of one client address's connections are stalled: still sending a request (head
or body) past a short grace.

`--max-connections` bounds the gateway's connections in all; a client that opens many and
sends each request a byte now and then (within the head and body deadlines) could still hold
every slot for as long as those deadlines allow, and everyone else would get 503. Counting
per address what is stalled, and refusing past a cap, leaves the other addresses their
slots: one address holds at most the cap in its slow phase, however slowly it sends.
Requests that arrive within the grace (a burst of fast ones) and requests already received
(streams being answered) do not count (gateway/front_door/head_deadline.py decides what is stalled).
"""

from __future__ import annotations

from collections import Counter


class PerIpCap:
    """Up to `limit` unfinished connections per address; `enter` says whether one more fits."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the per-address cap must be >= 1, not {limit}")
        self.limit = limit
        self._held: Counter[str] = Counter()

    def enter(self, ip: str) -> bool:
        """Count one more of `ip`'s connections, unless it already holds `limit`."""
        if self._held[ip] >= self.limit:
            return False
        self._held[ip] += 1
        return True

    def leave(self, ip: str) -> None:
        """One of `ip`'s counted connections is no longer sending (or is gone)."""
        self._held[ip] -= 1
        if self._held[ip] <= 0:
            del self._held[ip]

    def held(self, ip: str | None = None) -> int:
        """Connections counted now: `ip`'s, or every address's."""
        return self._held[ip] if ip is not None else sum(self._held.values())
