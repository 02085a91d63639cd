"""Which prefix-cache block hashes became findable in a KV pool and which stopped being so,
in order: what a worker publishes so the gateway's router can know where a prefix is
cached (gateway/routing/prefix_index.py).

The block pool records an event where a full block's hash is cached and where a cached
block is reused for other content (its hash evicted), one list append each; the worker's
loop drains the buffer between steps. Bounded: past `capacity` events not yet drained the
buffer forgets them and says so (`lost`), and the reader starts over from the pool's whole
set of hashes rather than keep an index it can no longer trust.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_CAPACITY = 65536  # far more than one step makes: a step caches and evicts at most its token budget's blocks


# One event: (stored, block_hash): the hash became findable (True) or stopped being so
# (False). A plain tuple, not a NamedTuple: making one is the hot path's cost.
KVEvent = tuple[bool, bytes]


class KVEventBatch(NamedTuple):
    """What a drain returns: the events in order, or `lost` (some were dropped: the reader
    must take the pool's whole set of hashes again; `events` is then empty)."""

    events: list[KVEvent]
    lost: bool


class KVEventBuffer:
    """Events since the last drain; one owner thread (the engine's) appends and drains."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity}: must be positive")
        self.capacity = capacity
        self._events: list[KVEvent] = []
        self._lost = False

    def stored(self, block_hash: bytes) -> None:
        if len(self._events) < self.capacity:
            self._events.append((True, block_hash))
        else:
            self.cleared()

    def removed(self, block_hash: bytes) -> None:
        if len(self._events) < self.capacity:
            self._events.append((False, block_hash))
        else:
            self.cleared()

    def cleared(self) -> None:
        """Events were dropped, or every hash forgotten at once (a reset of the prefix
        cache): the reader starts over from the pool's whole set."""
        self._events.clear()
        self._lost = True

    def drain(self) -> KVEventBatch:
        """The events since the last drain (none when `lost`), and an empty buffer."""
        events, lost = self._events, self._lost
        self._events, self._lost = [], False
        return KVEventBatch([] if lost else events, lost)

    @property
    def pending(self) -> bool:
        """Something to drain: events, or the news that some were lost."""
        return self._lost or bool(self._events)
