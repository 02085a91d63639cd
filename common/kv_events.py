"""A worker's prefix-cache events as a reader applies them: what crosses from a worker's
event log (worker/kv_event_log.py) through Stats (rpc/convert.py) to the gateway's prefix
index (gateway/routing/prefix_index.py)."""

from __future__ import annotations

from typing import NamedTuple


class KVEventsSince(NamedTuple):
    """The block hashes (common/block_hash.py) that became findable on a worker (`stored`)
    and stopped being so (`removed`) after the reader's cursor: each hash's last event, so
    the two are disjoint. With `resync`, `stored` is the first page of the worker's whole set
    in hash order, which replaces what the reader held for it. With `more`, the set goes on
    past `resync_after`, the last hash of the page: the reader asks again from there, and
    gets the events after its cursor among the hashes up to `resync_after` plus the next
    page. `last` is the reader's next cursor."""

    last: int
    resync: bool
    stored: list[bytes]
    removed: list[bytes]
    more: bool = False
    resync_after: bytes = b""
