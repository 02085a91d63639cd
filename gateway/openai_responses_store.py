"""Stored responses (`store: true`), for `previous_response_id` and `GET /v1/responses/{id}`.

    store = open_store(max_bytes, max_age_s, folder, processes)  # max_bytes 0: nothing is stored
    history = store.history(tenant, previous_id)       # the conversation to continue, or 400 / 404
    keep = store.keeper(tenant, conversation)          # keep(response) stores a finished answer

Each entry keeps the answer as it was sent and the conversation up to it as chat messages
(the input's, then the output's), so a request naming it continues exactly that. Entries
are keyed by tenant and id: another tenant's id is not found (a 404, as an unknown or
expired one), never served. The store is bounded twice: an entry older than `max_age_s` is
not found, and past `max_bytes` (each entry counted as its JSON, its whole conversation
included) the oldest go first.

One interface, two backings, as the gateway runs:

- `MemoryStore`, a lone gateway process (`--processes 1`): the entries in its memory. It
  has no folder to share, and needs none; a restart forgets them all.
- `FolderStore`, the processes of one gateway (`--processes N`): one file per entry in the
  front process's shared folder (`responses/`, gateway/processes.py), so a
  `previous_response_id` or a GET finds its entry whichever process the kernel hands the
  connection to, and a child restarted after a crash finds them too. The folder is removed
  when the front process ends: a restart of the gateway forgets them all, as a lone one's.
  Files rather than shared memory: an entry is written once and read a few times, a file
  is written whole under a temporary name and renamed (a reader sees it whole or not at
  all, as gateway/shared_membership.py's push), and a read of a page-cached file costs
  about what parsing the request's JSON does.

Why not the folder store alone: a lone process has no shared folder, and one it made for
itself would outlive it when it is killed (the front process removes its children's), and
memory loses nothing such a folder would keep: either is gone when the process ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import APIError
from gateway.openai_responses_protocol import FunctionCall, Message
from gateway.openai_responses_request import item_messages
from gateway.protocol import ChatMessage

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 3600.0
# Each process of a folder store looks over the folder every max_bytes / (OVERSHOOT x
# processes) bytes it writes: together they pass the bound by about max_bytes / OVERSHOOT
# at most (FolderStore's docstring).
OVERSHOOT = 8


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the answer as it was sent
    messages: tuple[ChatMessage, ...]  # the conversation up to and including it (no instructions)
    size: int  # bytes, as the bound counts them
    at: float  # when it was stored (the store's clock)


class ResponseStore(ABC):
    """Stored answers by tenant and id, bounded by age and bytes; `put` and `get` are the
    backing's, what a request asks of it (`history`, `keeper`) is the same for both."""

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

    def _too_big(self, response: dict, size: int) -> bool:
        if size <= self.max_bytes:
            return False
        log.info("response %s not stored: %d bytes is over the store's %d", response["id"], size, self.max_bytes)
        return True


def open_store(max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S, folder: Path | None = None,
               processes: int = 1) -> ResponseStore:
    """The store of a gateway process: in the shared `folder` of `processes` gateway
    processes, or (None) in this process's memory."""
    return MemoryStore(max_bytes, max_age_s) if folder is None else FolderStore(folder, max_bytes, max_age_s, processes)


class MemoryStore(ResponseStore):
    """The entries in this process's memory, oldest first; the bounds hold exactly."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(max_bytes, max_age_s)
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest first
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        size = len(_encode(tenant, response, messages))
        if self._too_big(response, size):
            return False
        key = (tenant, response["id"])
        old = self._entries.pop(key, None)
        self._size -= old.size if old else 0
        self._entries[key] = StoredResponse(response, tuple(messages), size, self._clock())
        self._size += size
        self._evict()
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._entries.get((tenant, response_id))

    def _evict(self) -> None:
        oldest_kept = self._clock() - self.max_age_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.at >= oldest_kept and self._size <= self.max_bytes:
                return
            del self._entries[key]
            self._size -= entry.size


class FolderStore(ResponseStore):
    """One file per entry in `folder`, shared by the `processes` gateway processes of one
    gateway, each with a store of its own over it.

    An entry's file is named by a hash of its tenant and id (a name no request can steer
    out of the folder, and another tenant's id names another file), holds both (checked
    as it is read: a 404 either way), is written under a temporary name and renamed (a
    reader sees it whole or not at all), readable by this user alone (0600, in the
    folder's 0700), and its modification time is when it was stored: one clock, the
    wall clock, for every process.

    Age holds exactly: an entry is found only while younger than `max_age_s`. Bytes hold
    within 1/OVERSHOOT: rather than a scan of the folder at every write, each process looks
    over it once it has written max_bytes / (OVERSHOOT x processes) since it last did,
    removing what is past its age, then the oldest until the files' bytes are within
    max_bytes. So between its looks each process adds less than that share (and its last
    entry), and the folder holds at most about max_bytes x (1 + 1/OVERSHOOT). A look is a
    directory scan (at 64 MiB of 5 KB entries, 13,000 files, tens of milliseconds), on a
    thread: once every 2 MiB a process stores, with 4 processes. An expired entry's file
    stays until a look, within that bound.
    """

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 processes: int = 1, clock: Callable[[], float] = time.time):
        super().__init__(max_bytes, max_age_s)
        self.folder, self._clock = Path(folder), clock
        self._look_every = max(1, max_bytes // (OVERSHOOT * processes))
        self._written = 0  # bytes this process stored since its last look over the folder
        self._looking = False  # a look is under way, on a thread

    @property
    def size(self) -> int:
        return sum(size for _, size, _ in self._files())

    def __len__(self) -> int:
        return len(self._files())

    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        data = _encode(tenant, response, messages)
        if self._too_big(response, len(data)):
            return False
        path = self._path(tenant, response["id"])
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        now = self._clock()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except OSError as e:  # e.g. the disk is full: the answer is sent all the same, and not kept
            log.warning("response %s not stored: %s", response["id"], e)
            tmp.unlink(missing_ok=True)
            return False
        self._written += len(data)
        if self._written >= self._look_every and not self._looking:
            self._written = 0
            self._look()
        return True

    def _look(self) -> None:
        """`_evict`, off the event loop when there is one: a scan of thousands of files takes
        tens of milliseconds, which every stream this process serves would wait."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script, a test): at once
            self._evict()
            return
        self._looking = True
        loop.run_in_executor(None, self._evict).add_done_callback(self._looked)

    def _looked(self, done: asyncio.Future) -> None:
        self._looking = False
        if not done.cancelled() and done.exception() is not None:
            log.error("looking over the stored responses failed", exc_info=done.exception())

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        try:
            with open(self._path(tenant, response_id), "rb") as f:
                at = os.fstat(f.fileno()).st_mtime
                data = f.read()
        except FileNotFoundError:
            return None
        if at < self._clock() - self.max_age_s:
            return None
        entry = json.loads(data)
        if (entry["tenant"], entry["id"]) != (tenant, response_id):  # two keys of one hash: not this one
            return None
        return StoredResponse(entry["response"], tuple(ChatMessage.model_validate(m) for m in entry["messages"]),
                              len(data), at)

    def _path(self, tenant: str, response_id: str) -> Path:
        return self.folder / f"{hashlib.sha256(json.dumps([tenant, response_id]).encode()).hexdigest()}.json"

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, path) of every file in the folder, a write under way included."""
        files = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed meanwhile, by another process's look
                    continue
                files.append((st.st_mtime, st.st_size, entry.path))
        return files

    def _evict(self) -> None:
        """What is past its age, then the oldest until the folder is within max_bytes."""
        oldest_kept = self._clock() - self.max_age_s
        kept, total = [], 0
        for mtime, size, path in self._files():
            if mtime < oldest_kept:
                _remove(path)
            else:
                kept.append((mtime, size, path))
                total += size
        for _, size, path in sorted(kept):
            if total <= self.max_bytes:
                return
            _remove(path)
            total -= size


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # another process's look removed it first
        pass


def _encode(tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bytes:
    """An entry as its bytes: what a folder store's file holds, and what either bound counts."""
    return json.dumps({"tenant": tenant, "id": response["id"], "response": response,
                       "messages": [m.model_dump(exclude_none=True) for m in messages]}).encode()


def _output_items(response: dict) -> list[Message | FunctionCall]:
    """An answer's output items as the input items they are when sent back."""
    return [FunctionCall.model_validate(item) if item["type"] == "function_call" else Message.model_validate(item)
            for item in response["output"]]
