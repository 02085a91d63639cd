"""API keys -> tenants, each with a concurrency limit, a queued-token limit and a priority.

With no keys configured the gateway runs open (one anonymous tenant, local use). Keys are
compared in constant time and never logged; a tenant at its limit gets 429 at once.

A tenant with no `max_concurrent` of its own (the anonymous one, and a tenants-file entry
that sets none) may run as many sequences as the decode pool holds: the sum over its
healthy workers of max_num_seqs + max_waiting, from their Stats (`Router.decode_pool_size`).
A fixed number would be a guess about a pool the gateway can measure: too low for a large
pool (refusals while the workers have room), and no protection on a small one, whose
workers refuse past their own queue bound anyway. So what bounds such a tenant is the workers' queues and
admission's TTFT prediction (gateway/admission.py). Until a decode worker has reported,
the limit is `STARTUP_SEQUENCES`. A tenant that must leave room for others sets
`max_concurrent`.

With several gateway processes (`python -m gateway --processes N`) the limits hold across
them exactly: each tenant's counts live in a row of a table every process maps
(gateway/tenant_table.py), and an admit checks the row's sums and adds to its own process's
cell under the row's lock. `in_flight` and `queued_tokens` stay this process's own share.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import APIError
from gateway.routing.router import PoolSize
from gateway.tenant_table import TenantRow, TenantTable

# The concurrency of a tenant with no max_concurrent before any decode worker has reported
# its size (the seconds after start-up): one worker's max_num_seqs at its default.
STARTUP_SEQUENCES = 64


@dataclass
class Tenant:
    name: str
    # Sequences at once (each choice of an n > 1 request is one); None: what the decode pool
    # holds (`pool_size`, see the module's docstring).
    max_concurrent: int | None = None
    max_queued_tokens: int = 1 << 20  # prompt + max_tokens of this tenant's requests in flight
    priority: int = 0  # lower runs first on the workers
    # False (default): this tenant's prompts hit only its own prefix cache entries, so no
    # other tenant can learn, from cached_tokens or latency, what its prompts begin with.
    share_prefix_cache: bool = False
    in_flight: int = 0  # this process's sequences and queued tokens (all of them, with one process)
    queued_tokens: int = 0
    # The decode pool's size now (Tenants.follow_pool; None: not followed); not a tenants-file key.
    pool_size: Callable[[], PoolSize | None] | None = field(default=None, init=False, repr=False, compare=False)
    # Its row of the counts every gateway process shares (Tenants.share; None: one process).
    shared: TenantRow | None = field(default=None, init=False, repr=False, compare=False)

    def concurrency_limit(self) -> tuple[int, str]:
        """The most sequences it may run at once, and where that number comes from."""
        if self.max_concurrent is not None:
            return self.max_concurrent, "its max_concurrent in the tenants file"
        size = self.pool_size() if self.pool_size is not None else None
        if size is None:
            return STARTUP_SEQUENCES, "the start-up limit, until a decode worker reports its size"
        return size.sequences, (f"what the decode pool holds: max_num_seqs + max_waiting of its "
                                f"{size.workers} decode worker{'s' if size.workers != 1 else ''}")

    def check_concurrency(self, choices: int = 1) -> None:
        """429 when `choices` more sequences would pass the limit (each choice of an n > 1
        request is a sequence on a decode worker); 400 when they never could (at the limit
        of now). Both say the limit and where it comes from."""
        limit, source = self.concurrency_limit()
        if choices > limit:
            raise APIError(400, f"n={choices}: tenant {self.name} may run {limit} sequences at once ({source}; "
                                "each choice is one)", "n", code="tenant_concurrency_limit")
        if self._totals()[0] + choices > limit:
            raise APIError(429, f"tenant {self.name}: {limit} concurrent sequences (choices of its requests) is the "
                                f"limit ({source})", code="tenant_concurrency_limit",
                           headers={"Retry-After": "1"}, reason="tenant_concurrency")

    def admit(self, tokens: int, choices: int = 1) -> None:
        with self._locked():
            self.check_concurrency(choices)
            if self._totals()[1] + tokens > self.max_queued_tokens:
                raise APIError(429, f"tenant {self.name}: {self.max_queued_tokens} tokens in flight is the limit",
                               code="tenant_token_limit", headers={"Retry-After": "1"}, reason="tenant_tokens")
            self._add(choices, tokens)

    def cache_salt(self, requested: str | None) -> str:
        """The prefix-cache salt of one request: the tenant's name (unless it shares its
        cache), then the client's own `cache_salt` if it sent one. Each part is tagged with
        what it is and prefixed with its length, so no client string (nor a tenant name with
        a separator in it) can spell another tenant's salt: a tenant that shares its cache
        sending `cache_salt: "tenant:a"` does not read isolated tenant a's entries."""
        parts = [] if self.share_prefix_cache else [("tenant", self.name)]
        if requested:
            parts.append(("client", requested))
        return "".join(f"{tag}{len(value)}:{value};" for tag, value in parts)

    def release(self, tokens: int, choices: int = 1) -> None:
        with self._locked():
            self._add(-choices, -tokens)

    def _totals(self) -> tuple[int, int]:
        """(sequences, queued tokens) over every gateway process."""
        return self.shared.totals() if self.shared is not None else (self.in_flight, self.queued_tokens)

    def _locked(self) -> contextlib.AbstractContextManager:
        return self.shared.locked() if self.shared is not None else contextlib.nullcontext()

    def _add(self, sequences: int, tokens: int) -> None:
        self.in_flight += sequences
        self.queued_tokens += tokens
        if self.shared is not None:
            self.shared.add(sequences, tokens)


@dataclass
class Tenants:
    by_key: dict[str, Tenant] = field(default_factory=dict)
    # Open mode: one trust domain, one shared cache (a client may still send a cache_salt).
    anonymous: Tenant = field(default_factory=lambda: Tenant("anonymous", share_prefix_cache=True))

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """{"tenants": [{"name": ..., "api_keys": [...], "max_concurrent": .., "max_queued_tokens": ..,
        "priority": ..}]}; an entry without max_concurrent runs what the decode pool holds."""
        data = json.loads(Path(path).read_text())
        by_key: dict[str, Tenant] = {}
        names: set[str] = set()
        for entry in data.get("tenants", []):
            keys = entry.pop("api_keys", [])
            if not keys:
                raise ValueError(f"tenant {entry.get('name')!r} has no api_keys")
            tenant = Tenant(**entry)
            # a name is a tenant's prefix-cache salt and its stored responses' namespace: two
            # entries named alike would share both
            if tenant.name in names:
                raise ValueError(f"tenant {tenant.name!r} is named twice in {path}: each entry needs a name of its "
                                 "own (give one entry several api_keys to let it use more than one key)")
            names.add(tenant.name)
            for key in keys:
                if key in by_key:
                    raise ValueError(f"an API key of tenant {tenant.name!r} is also used by {by_key[key].name!r}")
                by_key[key] = tenant
        return cls(by_key)

    @property
    def open(self) -> bool:
        return not self.by_key

    def all(self) -> list[Tenant]:
        """Every tenant once, the anonymous one first, then in the file's order: the rows of
        the shared table, the same in every process that reads the same file."""
        tenants = [self.anonymous]
        for tenant in self.by_key.values():  # a tenant with several keys appears once
            if not any(tenant is t for t in tenants):
                tenants.append(tenant)
        return tenants

    def follow_pool(self, pool_size: Callable[[], PoolSize | None]) -> None:
        """Where tenants with no max_concurrent read the decode pool's size (the router's)."""
        for tenant in self.all():
            tenant.pool_size = pool_size

    def share(self, table: TenantTable) -> None:
        """Count in `table` from now on, a row per tenant (`all()`'s order), with the other
        gateway processes; called before any request is admitted. The table's last row is
        the retry budget's (gateway/retry_budget.py), not a tenant's."""
        tenants = self.all()
        if len(tenants) + 1 != table.rows:
            raise ValueError(f"{table.path} has {table.rows - 1} tenant rows, the tenants file {len(tenants)}")
        for row, tenant in enumerate(tenants):
            tenant.shared = table.row(row)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant of a request's key: `Authorization: Bearer <key>` (OpenAI's clients), or
        else `x-api-key: <key>` (`api_key`, Anthropic's); 401 without a valid one."""
        if self.open:
            return self.anonymous
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            key = api_key or ""
        if not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key")
        found = None
        for known, tenant in self.by_key.items():  # every key compared, in constant time
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return found
