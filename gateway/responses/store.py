"""Stored responses (`store: true`), for `previous_response_id` and `GET /v1/responses/{id}`.

    store = MemoryStore(max_bytes, max_age_s)          # or FolderStore (openai_responses_folder_store.py)
    history = await store.history(tenant, previous_id) # the conversation to continue, or 400 / 404
    entry = await store.find(tenant, response_id)      # GET: the entry, or 400 / 404
    keep = store.keeper(tenant, conversation)          # await keep(response) stores a finished answer

Each entry keeps the answer as it was sent and the conversation up to it as chat messages
(the input's, then the output's), so a request naming it continues exactly that. Entries
are keyed by tenant and id: another tenant's id is not found (a 404, as an unknown or
expired one), never served. The store is bounded twice: an entry older than `max_age_s` is
not found, and the entries' bytes (each counted as its JSON, its whole conversation
included) are kept within `max_bytes` (0: nothing is stored).

Which entries go when the bytes are over: the oldest of the tenant that holds the most
bytes, then again, until they are within. So tenants share the bound fairly without a
setting of their own: a tenant that holds no more than its share (max_bytes / the tenants
holding entries) never loses an entry to another's writes (when the total is over, the one
that holds the most holds more than the share), a tenant that writes past its share evicts
its own oldest entries, and a lone tenant (a gateway without API keys) may use it all.

One interface, two backings, as the gateway runs:

- `MemoryStore`, a lone gateway process (`--processes 1`): the entries in its memory. It
  has no folder to share, and needs none; a restart forgets them all.
- `FolderStore` (gateway/responses/folder_store.py), the processes of one gateway
  (`--processes N`): one file per entry in the front process's shared folder.

`put` and `get` are the backing's, called as they are by a script or a test; the gateway's
event loop calls them through `store` and `fetch` (and `history`, `find`, the keeper),
which a backing doing file I/O runs on a thread.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.responses.protocol import FunctionCall, Message
from gateway.responses.request import item_messages
from gateway.completions.protocol import ChatMessage

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 3600.0

Keep = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the answer as it was sent
    messages: tuple[ChatMessage, ...]  # the conversation up to and including it (no instructions)
    size: int  # bytes, as the bound counts them
    at: float  # when it was stored (the store's clock)


class ResponseStore(ABC):
    """Stored answers by tenant and id, bounded by age and bytes; `put` and `get` are the
    backing's, what a request asks of it (`history`, `find`, `keeper`) is the same for both."""

    def __init__(self, max_bytes: int, max_age_s: float):
        self.max_bytes, self.max_age_s = max_bytes, max_age_s

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @abstractmethod
    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        """Keeps `response` for `tenant` under its id; False when it is not kept (it alone is
        over the bound, or its file could not be written)."""

    @abstractmethod
    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`tenant`'s entry of that id, if it is still kept."""

    @property
    @abstractmethod
    def size(self) -> int:
        """The bytes the entries hold now, as the bound counts them."""

    async def store(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        """`put`, from the event loop (a backing doing file I/O does it on a thread)."""
        return self.put(tenant, response, messages)

    async def fetch(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`get`, from the event loop (a backing doing file I/O does it on a thread)."""
        return self.get(tenant, response_id)

    async def find(self, tenant: str, response_id: str, param: str) -> StoredResponse:
        """`tenant`'s entry of that id; APIError naming `param`: 400 when nothing is stored,
        404 when it is not `tenant`'s or no longer kept."""
        if not self.enabled:
            raise APIError(400, f"{param}: this server stores no responses (--response-store-bytes 0); "
                                "send the conversation's items as input instead", param)
        entry = await self.fetch(tenant, response_id)
        if entry is None:
            raise APIError(404, f"{param}: response {response_id!r} not found", param)
        return entry

    async def history(self, tenant: str, previous_id: str | None) -> tuple[ChatMessage, ...]:
        """The conversation `previous_id` ends (none without one); APIError as `find`."""
        if previous_id is None:
            return ()
        return (await self.find(tenant, previous_id, "previous_response_id")).messages

    def keeper(self, tenant: str, conversation: Sequence[ChatMessage]) -> Keep | None:
        """What stores an answer to `conversation` once it is finished (None: nothing is stored)."""
        if not self.enabled:
            return None

        async def keep(response: dict) -> None:
            await self.store(tenant, response, [*conversation, *item_messages(_output_items(response))])
        return keep

    def too_big(self, response: dict, size: int) -> bool:
        if size <= self.max_bytes:
            return False
        log.info("response %s not stored: %d bytes is over the store's %d", response["id"], size, self.max_bytes)
        return True


class MemoryStore(ResponseStore):
    """The entries in this process's memory, each tenant's oldest first; the bounds hold
    exactly."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(max_bytes, max_age_s)
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}  # each oldest first
        self._held: dict[str, int] = {}  # bytes by tenant
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def __len__(self) -> int:
        return sum(map(len, self._tenants.values()))

    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        size = len(encode(tenant, response, messages))
        if self.too_big(response, size):
            return False
        self._remove(tenant, response["id"])  # a new one of the same id is the newest
        self._tenants.setdefault(tenant, OrderedDict())[response["id"]] = StoredResponse(
            response, tuple(messages), size, self._clock())
        self._held[tenant] = self._held.get(tenant, 0) + size
        self._size += size
        self._evict()
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._tenants.get(tenant, {}).get(response_id)

    def _evict(self) -> None:
        """What is past its age; then, while over max_bytes, the largest holder's oldest."""
        oldest_kept = self._clock() - self.max_age_s
        for tenant, entries in list(self._tenants.items()):
            while entries and next(iter(entries.values())).at < oldest_kept:
                self._remove(tenant, next(iter(entries)))
        while self._size > self.max_bytes:
            tenant = max(self._held, key=self._held.__getitem__)
            self._remove(tenant, next(iter(self._tenants[tenant])))

    def _remove(self, tenant: str, response_id: str) -> None:
        entries = self._tenants.get(tenant, {})
        entry = entries.pop(response_id, None)
        if entry is None:
            return
        self._size -= entry.size
        self._held[tenant] -= entry.size
        if not entries:
            del self._tenants[tenant], self._held[tenant]


def encode(tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bytes:
    """An entry as its bytes: what a folder store's file holds, and what either bound counts."""
    return json.dumps({"tenant": tenant, "id": response["id"], "response": response,
                       "messages": [m.model_dump(exclude_none=True) for m in messages]}).encode()


def _output_items(response: dict) -> list[Message | FunctionCall]:
    """An answer's output items as the input items they are when sent back."""
    return [FunctionCall.model_validate(item) if item["type"] == "function_call" else Message.model_validate(item)
            for item in response["output"]]
