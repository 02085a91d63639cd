"""One retry budget for the gateway's own retries, shared by all its processes.

The gateway retries on its own in three places: a request whose decode worker failed before
its first token goes to another (gateway/request_path.py `_start`), a stream whose worker
died mid-way is replayed on another, and a drained worker's streams are handed off
(gateway/decode_stream.py). Each helps one request; together, when a pool is failing, they
multiply the load on the workers left (the seed's "one client team's aggressive retries
multiply load on an already-saturated backend", from inside). So, as a service mesh's
retry budget does (Envoy's `retry_budget`: 20% of the requests active, at least 3), the
retry attempts under way (from the decision to retry to the new worker's first message or
failure) may be at most RATIO of the requests in flight, or MINIMUM when that is more.

Past it a retry waits for room, polling the shared count, until its request's deadline; only
then is it refused (the request ends with the failure it met, a clean error). A worker's
crash with many streams on it is so spread out in time instead of landing on the others at
once, and loses no stream: "nothing is lost when the system changes shape" holds, while a
pool failing every retry sees at most the budget's share in retries at any moment. A
hand-off is planned, not a failure: it takes its place in the count (others then find the
budget spent) but never waits. With several gateway processes the counts live in one row
of the table they share (gateway/tenant_table.py), so the budget is the whole gateway's,
exactly. `pdserve_retry_budget_total{kind, outcome}` counts each retry: spent at once,
waited (for room), or refused (its deadline passed while it waited).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from gateway.metrics import RETRY_BUDGET
from gateway.tenant_table import TenantRow

RATIO = 0.2  # retry attempts under way, at most this share of the requests in flight ...
MINIMUM = 3  # ... or this many, whichever is more
POLL_S = 0.02  # how often a waiting retry looks for room (other processes free it without a signal)


class RetryBudget:
    def __init__(self, ratio: float = RATIO, minimum: int = MINIMUM):
        self.ratio, self.minimum = ratio, minimum
        self.requests = 0  # this process's requests in flight, and retry attempts under way
        self.retrying = 0
        self.shared: TenantRow | None = None  # the gateway's processes' row (share)

    def share(self, row: TenantRow) -> None:
        """Count in `row` with the other gateway processes from now on (before any request)."""
        self.shared = row

    def started(self) -> None:
        """A request is in flight."""
        with self._locked():
            self._add(1, 0)

    def ended(self) -> None:
        with self._locked():
            self._add(-1, 0)

    async def acquire(self, kind: str, deadline: float, required: bool = False) -> bool:
        """Room for one retry attempt, waiting for it until `deadline` (time.monotonic());
        False when it passed. `required` (a hand-off): taken at once, over the budget if need
        be. `release` gives the room back once the attempt has its answer."""
        waited = False
        while True:
            with self._locked():
                requests, retrying = self._totals()
                if required or retrying + 1 <= max(self.minimum, self.ratio * requests):
                    self._add(0, 1)
                    RETRY_BUDGET.labels(kind, "waited" if waited else "spent").inc()
                    return True
            if time.monotonic() >= deadline:
                RETRY_BUDGET.labels(kind, "refused").inc()
                return False
            waited = True
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def release(self) -> None:
        with self._locked():
            self._add(0, -1)

    def _totals(self) -> tuple[int, int]:
        return self.shared.totals() if self.shared is not None else (self.requests, self.retrying)

    def _locked(self) -> contextlib.AbstractContextManager:
        return self.shared.locked() if self.shared is not None else contextlib.nullcontext()

    def _add(self, requests: int, retrying: int) -> None:
        self.requests += requests
        self.retrying += retrying
        if self.shared is not None:
            self.shared.add(requests, retrying)
