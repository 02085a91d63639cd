"""One retry budget for the gateway's own retries, shared by all its processes.

The gateway retries on its own in three places: a request whose decode worker failed before
its first token goes to another (gateway/request_path.py `_start`), a stream whose worker
died mid-way is replayed on another, and a drained worker's streams are handed off
(gateway/decode_stream.py). Each helps one request; together, when a pool is failing, they
multiply the load on the workers left (the seed's "one client team's aggressive retries
multiply load on an already-saturated backend", from inside). So, as a service mesh's
retry budget does (Envoy's `retry_budget`: 20% of the requests active, at least 3), the
requests being retried may be at most RATIO of the requests in flight, or MINIMUM when
that is more; past it a retry is refused and the request ends with the failure it met.

Counted per request: a request counts as retried from its first retry until it ends, so
its further retries (bounded per request: MAX_DECODE_ATTEMPTS, MAX_REPLAYS) cost nothing
more. A hand-off is planned, not a failure: it is counted (it uses the budget others then
find spent) but never refused, so a drain loses no stream. With several gateway processes
the counts live in one row of the table they share (gateway/tenant_table.py), so the budget
is the whole gateway's, exactly. `pdserve_retry_budget_total{kind, outcome}` counts each
retry spent or refused.
"""

from __future__ import annotations

import contextlib

from gateway.metrics import RETRY_BUDGET
from gateway.tenant_table import TenantRow

RATIO = 0.2  # requests being retried, at most this share of the requests in flight ...
MINIMUM = 3  # ... or this many, whichever is more


class RetryBudget:
    def __init__(self, ratio: float = RATIO, minimum: int = MINIMUM):
        self.ratio, self.minimum = ratio, minimum
        self.requests = 0  # this process's requests in flight, and those of them retried
        self.retried = 0
        self.shared: TenantRow | None = None  # the gateway's processes' row (share)

    def share(self, row: TenantRow) -> None:
        """Count in `row` with the other gateway processes from now on (before any request)."""
        self.shared = row

    def started(self) -> None:
        """A request is in flight."""
        with self._locked():
            self._add(1, 0)

    def ended(self, retried: bool) -> None:
        with self._locked():
            self._add(-1, -int(retried))

    def retry(self, kind: str, required: bool = False) -> bool:
        """Whether a request in flight, not retried yet, may be (`required`: a hand-off,
        counted and never refused); counts it as retried if so."""
        with self._locked():
            requests, retried = self._totals()
            if not required and retried + 1 > max(self.minimum, self.ratio * requests):
                RETRY_BUDGET.labels(kind, "refused").inc()
                return False
            self._add(0, 1)
        RETRY_BUDGET.labels(kind, "spent").inc()
        return True

    def _totals(self) -> tuple[int, int]:
        return self.shared.totals() if self.shared is not None else (self.requests, self.retried)

    def _locked(self) -> contextlib.AbstractContextManager:
        return self.shared.locked() if self.shared is not None else contextlib.nullcontext()

    def _add(self, requests: int, retried: int) -> None:
        self.requests += requests
        self.retried += retried
        if self.shared is not None:
            self.shared.add(requests, retried)
