"""The prefix cache's events as a worker publishes them (docs/workers.md, "Stats"): each event
of the engine's buffer (engine/kv_events.py) gets a sequence number here, and each gateway
asks its Stats for the events after the last one it applied, its cursor. Several gateways
read one log, each at its own cursor; nothing is consumed by a read.

Bounded: the log keeps the last `capacity` events. A cursor older than that, one of
another incarnation, or any cursor after the engine's buffer overflowed, is answered with
a resync: the whole set of hashes findable now, which replaces what the reader held.
The loop thread writes (`take`, once per iteration); gRPC threads read (`since`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from common.kv_events import KVEventsSince
from engine.kv_events import KVEventBatch

DEFAULT_CAPACITY = 16384  # events a reader may fall behind by before it must resync


class KVEventLog:
    """One worker's numbered events and the set of hashes they add up to."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._last = 0  # the sequence number of the newest event
        self._floor = 0  # the oldest cursor answered with events: every event after it is kept
        self._events: deque[tuple[int, bool, bytes]] = deque()
        self._stored: set[bytes] = set()  # every hash findable as of `_last`

    def take(self, batch: KVEventBatch, cached_hashes: Callable[[], list[bytes]]) -> None:
        """The engine's drained events (on its thread); after a `lost` batch the pool's
        whole set (`cached_hashes`) replaces the log's, and every reader resyncs."""
        if not batch.events and not batch.lost:
            return
        with self._lock:
            if batch.lost:
                self._stored = set(cached_hashes())
                self._events.clear()
                self._last += 1
                self._floor = self._last
                return
            for stored, block_hash in batch.events:
                self._last += 1
                self._events.append((self._last, stored, block_hash))
                if stored:
                    self._stored.add(block_hash)
                else:
                    self._stored.discard(block_hash)
            while len(self._events) > self.capacity:
                self._floor = self._events.popleft()[0]

    def since(self, cursor: int | None) -> KVEventsSince:
        """The events after `cursor` (None: a reader with nothing, or of another incarnation)."""
        with self._lock:
            if cursor is None or not self._floor <= cursor <= self._last:
                return KVEventsSince(self._last, True, list(self._stored), [])
            last: dict[bytes, bool] = {}
            for seq, stored, block_hash in reversed(self._events):
                if seq <= cursor:
                    break
                last.setdefault(block_hash, stored)
            return KVEventsSince(self._last, False, [h for h, s in last.items() if s],
                                 [h for h, s in last.items() if not s])

    def __len__(self) -> int:
        """Hashes findable now, as far as the log knows."""
        return len(self._stored)
