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

import math


class PerIpCap:
    """Up to `limit` unfinished connections per address; `enter` says whether one more fits.
    Each counted connection comes with the time its deadline cuts it off at the latest, so a
    refusal can say when the address has a slot again (`next_free_s`: its Retry-After)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the per-address cap must be >= 1, not {limit}")
        self.limit = limit
        self._held: dict[str, list[float]] = {}  # address -> the deadlines of its counted connections

    def enter(self, ip: str, ends_by: float = math.inf) -> bool:
        """Count one more of `ip`'s connections (cut off by `ends_by` at the latest), unless
        it already holds `limit`."""
        held = self._held.setdefault(ip, [])
        if len(held) >= self.limit:
            return False
        held.append(ends_by)
        return True

    def leave(self, ip: str, ends_by: float = math.inf) -> None:
        """One of `ip`'s counted connections is no longer sending (or is gone)."""
        held = self._held[ip]
        held.remove(ends_by)
        if not held:
            del self._held[ip]

    def next_free_s(self, ip: str, now: float) -> float:
        """Seconds until one of `ip`'s counted connections is cut off at the latest (0 when
        it has a slot now; inf when none has a deadline)."""
        held = self._held.get(ip, [])
        return 0.0 if len(held) < self.limit else max(0.0, min(held) - now)

    def held(self, ip: str | None = None) -> int:
        """Connections counted now: `ip`'s, or every address's."""
        return len(self._held.get(ip, ())) if ip is not None else sum(map(len, self._held.values()))
