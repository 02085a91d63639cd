"""Which worker holds how much of a prompt's prefix: the gateway's index of the prefix-cache
block hashes each worker published (their Stats' KV events: worker/kv_event_log.py), which
the router ranks workers by (gateway/routing/router.py).

Hashes are common/block_hash.py's chained hashes under the request's cache salt, the same
the workers' pools find blocks by: a tenant's salted prompt never matches another tenant's
entries. A worker is known by its address and its incarnation (the name its Stats give): a
new incarnation at an address drops the old one's entries, and a worker that leaves the
membership is forgotten. Bounded: at most `max_entries` (hash, worker) pairs; a worker whose
entries would pass the bound is dropped whole (its next Stats resync it, if there is room
then) rather than the index grow or hold half a worker's set.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.kv_events import KVEventsSince

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 4_000_000  # (hash, worker) pairs: ~0.9 GiB at worst (bench/prefix_index_cost.py), 100+ workers of 32k blocks each


@dataclass
class _Worker:
    name: str  # role-id-incarnation, as its Stats say
    cursor: int | None = None  # the last event applied (None: resync next time)
    resync_after: bytes = b""  # mid-resync: the last hash of the page applied (worker/kv_event_log.py)
    hashes: set[bytes] = field(default_factory=set)


class PrefixIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._holders: dict[bytes, set[str]] = {}  # hash -> addresses holding it
        self._workers: dict[str, _Worker] = {}  # by address
        self.entries = 0  # sum of the workers' set sizes

    # -- what the Stats rounds feed -----------------------------------------------------

    def cursor(self, address: str) -> tuple[str, int, bytes] | None:
        """(incarnation, last event applied, the last hash of a resync page applied or b"")
        to ask the worker's Stats from; None: ask for all."""
        w = self._workers.get(address)
        return None if w is None or w.cursor is None else (w.name, w.cursor, w.resync_after)

    def apply(self, address: str, name: str, events: KVEventsSince) -> None:
        """A worker's answer: events after the cursor it was asked from, or its whole set."""
        w = self._workers.get(address)
        if w is not None and w.name != name:
            log.info("prefix index: %s is %s now (was %s): its %d entries dropped", address, name, w.name,
                     len(w.hashes))
            self._drop(address)
            w = None
        if w is None:
            w = self._workers[address] = _Worker(name)
        if events.resync:
            self._clear(address, w)
        elif w.cursor is None:
            return  # an answer to a question asked before a drop: wait for the resync
        for h in events.removed:
            if h in w.hashes:
                w.hashes.remove(h)
                self._unhold(h, address)
                self.entries -= 1
        added = [h for h in events.stored if h not in w.hashes]
        if self.entries + len(added) > self.max_entries:
            log.warning("prefix index full (%d of %d entries): %s's %d entries dropped until there is room",
                        self.entries, self.max_entries, name, len(w.hashes) + len(added))
            self._clear(address, w)
            w.cursor = None
            return
        for h in added:
            w.hashes.add(h)
            self._holders.setdefault(h, set()).add(address)
        self.entries += len(added)
        w.cursor = events.last
        w.resync_after = events.resync_after if events.more else b""

    def retain(self, addresses: Iterable[str]) -> None:
        """The membership: every other worker's entries go."""
        keep = set(addresses)
        for address in [a for a in self._workers if a not in keep]:
            self._drop(address)

    # -- what routing asks --------------------------------------------------------------

    def longest_prefix(self, candidates: Iterable[str], hashes: Sequence[bytes]) -> dict[str, int]:
        """For each candidate holding the prompt's first block: how many of its leading
        blocks (`hashes`, in order) it holds in a row, as its pool would find them."""
        alive = set(candidates)
        matched: dict[str, int] = {}
        held = 0  # blocks every address in `alive` holds in a row
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            if not alive <= holders:  # some drop out here (the rare case: most blocks keep the same holders)
                for address in alive - holders:
                    if held:
                        matched[address] = held
                alive &= holders
                if not alive:
                    break
            held += 1
        for address in alive:
            if held:
                matched[address] = held
        return matched

    def size(self, address: str) -> int:
        w = self._workers.get(address)
        return 0 if w is None else len(w.hashes)

    def names(self) -> dict[str, str]:
        """address -> the incarnation whose entries the index holds."""
        return {a: w.name for a, w in self._workers.items()}

    # -- inside -------------------------------------------------------------------------

    def _clear(self, address: str, w: _Worker) -> None:
        for h in w.hashes:
            self._unhold(h, address)
        self.entries -= len(w.hashes)
        w.hashes = set()

    def _drop(self, address: str) -> None:
        w = self._workers.pop(address)
        self._clear(address, w)

    def _unhold(self, h: bytes, address: str) -> None:
        holders = self._holders[h]
        holders.discard(address)
        if not holders:
            del self._holders[h]
