"""The prefix cache's events as a worker publishes them (docs/workers.md, "Stats"): each event
of the engine's buffer (engine/kv_events.py) gets a sequence number here, and each gateway
asks its Stats for the events after the last one it applied, its cursor. Several gateways
read one log, each at its own cursor; nothing is consumed by a read.

Bounded: the log keeps the last `capacity` events. A cursor older than that, one of
another incarnation, or any cursor after the engine's buffer overflowed, is answered with
a resync: the whole set of hashes findable now, which replaces what the reader held. A
resync comes in pages of at most `page` hashes in hash order (a worker caching a million
blocks would otherwise answer one Stats of ~18 MiB, past gRPC's message bound): the reader
asks again from the last hash it got, and each answer brings the events after its cursor
among the hashes it already has, plus the next page of the set as it is now (a sorted
snapshot, taken once and shared by every reader's pages, and the events since it). The
gateway asks for the pages back to back within one Stats round (gateway/readiness.py); a
reader whose cursor falls out of the log meanwhile starts over.
The loop thread writes (`take`, once per iteration); gRPC threads read (`since`).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable

from common.kv_events import KVEventsSince
from engine.kv_events import KVEventBatch

DEFAULT_CAPACITY = 16384  # events a reader may fall behind by before it must resync
# Hashes in one resync page: ~1.2 MiB on the wire (16-byte hashes), whatever the pool holds;
# with the events of a round (at most DEFAULT_CAPACITY) an answer stays well under the bound.
RESYNC_PAGE = 65536


class KVEventLog:
    """One worker's numbered events and the set of hashes they add up to."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, page: int = RESYNC_PAGE) -> None:
        self.capacity, self.page = capacity, page
        self._lock = threading.Lock()
        self._last = 0  # the sequence number of the newest event
        self._floor = 0  # the oldest cursor answered with events: every event after it is kept
        self._events: deque[tuple[int, bool, bytes]] = deque()
        self._stored: set[bytes] = set()  # every hash findable as of `_last`
        self._snap: tuple[int, list[bytes]] | None = None  # a resync's pages: (as of which event, sorted set)

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

    def since(self, cursor: int | None, resync_after: bytes = b"") -> KVEventsSince:
        """The events after `cursor` (None: a reader with nothing, or of another
        incarnation); `resync_after`: the last hash of the resync page the reader applied
        (b"": it is not in a resync)."""
        with self._lock:
            fresh = cursor is None or not self._floor <= cursor <= self._last
            if not fresh and not resync_after:
                changed = self._changed_after(cursor)
                return KVEventsSince(self._last, False, [h for h, (_, s) in changed.items() if s],
                                     [h for h, (_, s) in changed.items() if not s])
        for _ in range(3):
            snapshot = self._snapshot()
            with self._lock:
                if snapshot[0] >= self._floor:
                    return self._page(cursor, resync_after, snapshot)
                self._snap = None  # it aged out while it was sorted (a burst of events): sort anew
        with self._lock:  # three in a row: the whole set at once, as one answer
            return KVEventsSince(self._last, True, list(self._stored), [])

    def _page(self, cursor: int | None, resync_after: bytes, snapshot: tuple[int, list[bytes]]) -> KVEventsSince:
        """A resync's page from `snapshot` (still within the log), and the events that bring
        it and what the reader holds up to now. Under the lock."""
        fresh = cursor is None or not self._floor <= cursor <= self._last
        taken, hashes = snapshot
        after = b"" if fresh else resync_after
        i = bisect.bisect_right(hashes, after) if after else 0
        j = min(i + self.page, len(hashes))
        more = j < len(hashes)
        end = hashes[j - 1] if more else None  # this page covers (after, end]; the last page all past `after`
        changed = self._changed_after(taken if fresh else min(taken, cursor))

        def in_page(h: bytes) -> bool:
            return h > after and (end is None or h <= end)

        # the page as the snapshot has it, less what was removed since; what was stored
        # since in its range; and, for what the reader holds, the events after its cursor
        stored = [h for h in hashes[i:j] if changed.get(h, (0, True))[1]]
        stored += [h for h, (seq, s) in changed.items()
                   if s and ((in_page(h) and seq > taken) or (not fresh and h <= after and seq > cursor))]
        removed = [] if fresh else [h for h, (seq, s) in changed.items() if not s and h <= after and seq > cursor]
        return KVEventsSince(self._last, fresh, list(dict.fromkeys(stored)), removed, more, end if more else b"")

    def _changed_after(self, seq: int) -> dict[bytes, tuple[int, bool]]:
        """Each hash's last event after `seq`: (its number, stored). Under the lock."""
        last: dict[bytes, tuple[int, bool]] = {}
        for n, stored, block_hash in reversed(self._events):
            if n <= seq:
                break
            last.setdefault(block_hash, (n, stored))
        return last

    def _snapshot(self) -> tuple[int, list[bytes]]:
        """The findable set in hash order as of an event number the log still holds events
        after (so pages and events add up to now), sorted outside the lock: one sort serves
        every reader's pages until it ages out."""
        with self._lock:
            snap = self._snap
            if snap is not None and snap[0] >= self._floor:
                return snap
            taken, hashes = self._last, list(self._stored)
        hashes.sort()
        with self._lock:
            if self._snap is None or self._snap[0] < taken:
                self._snap = (taken, hashes)
        return taken, hashes

    def __len__(self) -> int:
        """Hashes findable now, as far as the log knows."""
        return len(self._stored)
