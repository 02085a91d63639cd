"""Stored responses (`store: true`), for `previous_response_id` and `GET /v1/responses/{id}`.

    store = ResponseStore(max_bytes, max_age_s)       # max_bytes 0: nothing is stored
    history = store.history(tenant, previous_id)       # the conversation to continue, or 400 / 404
    keep = store.keeper(tenant, conversation)          # keep(response) stores a finished answer

Each entry keeps the answer as it was sent and the conversation up to it as chat messages
(the input's, then the output's), so a request naming it continues exactly that. Entries
are keyed by tenant and id: another tenant's id is not found (a 404, as an unknown or
expired one), never served. The store is bounded twice: an entry older than `max_age_s` is
dropped, and past `max_bytes` (the entries' JSON size, each counting its whole
conversation) the oldest go first. It lives in one gateway process's memory: with
`--processes N` an id is found only by the process that answered it, and a restart
forgets them all.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.openai_responses_protocol import FunctionCall, Message
from gateway.openai_responses_request import item_messages
from gateway.protocol import ChatMessage

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the answer as it was sent
    messages: tuple[ChatMessage, ...]  # the conversation up to and including it (no instructions)
    size: int  # bytes, as the bound counts them
    at: float  # when it was stored (the clock's time)


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.max_age_s, self._clock = max_bytes, max_age_s, clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest first
        self.size = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        """Keeps `response` for `tenant` under its id; False when it alone is over the bound."""
        size = len(json.dumps(response)) + sum(len(m.model_dump_json(exclude_none=True)) for m in messages)
        if size > self.max_bytes:
            log.info("response %s not stored: %d bytes is over the store's %d", response["id"], size, self.max_bytes)
            return False
        key = (tenant, response["id"])
        old = self._entries.pop(key, None)
        self.size -= old.size if old else 0
        self._entries[key] = StoredResponse(response, tuple(messages), size, self._clock())
        self.size += size
        self._evict()
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`tenant`'s entry of that id, if it is still kept."""
        self._evict()
        return self._entries.get((tenant, response_id))

    def history(self, tenant: str, previous_id: str | None) -> tuple[ChatMessage, ...]:
        """The conversation `previous_id` ends (none without one); APIError 400 when nothing
        is stored, 404 when it is not `tenant`'s or no longer kept."""
        if previous_id is None:
            return ()
        if not self.enabled:
            raise APIError(400, "previous_response_id: this server stores no responses (--response-store-bytes 0); "
                                "send the conversation's items as input instead", "previous_response_id")
        entry = self.get(tenant, previous_id)
        if entry is None:
            raise APIError(404, f"previous_response_id: response {previous_id!r} not found", "previous_response_id")
        return entry.messages

    def keeper(self, tenant: str, conversation: Sequence[ChatMessage]) -> Callable[[dict], None] | None:
        """What stores an answer to `conversation` once it is finished (None: nothing is stored)."""
        if not self.enabled:
            return None

        def keep(response: dict) -> None:
            self.put(tenant, response, [*conversation, *item_messages(_output_items(response))])
        return keep

    def _evict(self) -> None:
        oldest_kept = self._clock() - self.max_age_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.at >= oldest_kept and self.size <= self.max_bytes:
                return
            del self._entries[key]
            self.size -= entry.size


def _output_items(response: dict) -> list[Message | FunctionCall]:
    """An answer's output items as the input items they are when sent back."""
    return [FunctionCall.model_validate(item) if item["type"] == "function_call" else Message.model_validate(item)
            for item in response["output"]]
