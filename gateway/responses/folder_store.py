"""Stored responses as files in a folder the processes of one gateway share (`--processes
N`), the backing of gateway/responses/store.py's interface that they use.

    store = FolderStore(folder, max_bytes, max_age_s, processes)

One file per entry in the front process's shared folder (`responses/`, gateway/processes.py),
so a `previous_response_id` or a GET finds its entry whichever process the kernel hands the
connection to, and a child restarted after a crash finds them too. The folder is removed
when the front process ends: a restart of the gateway forgets them all, as a lone one's.
Files rather than shared memory: an entry is written once and read a few times, a file is
written whole under a temporary name and renamed (a reader sees it whole or not at all, as
gateway/shared_membership.py's push), and a read of a page-cached file costs about what
parsing the request's JSON does; on the event loop's thread it would still stall every
stream the process serves, so the loop reads and writes them on a thread (`fetch`, `store`).

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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from gateway.responses.store import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    ResponseStore,
    StoredResponse,
    encode,
)
from gateway.completions.protocol import ChatMessage

log = logging.getLogger(__name__)

# Each process of a folder store looks over the folder every max_bytes / (OVERSHOOT x
# processes) bytes it writes: together they pass the bound by about max_bytes / OVERSHOOT
# at most (FolderStore's docstring).
OVERSHOOT = 8
# A temporary file (a write under way: `.{name}.{pid}`) older than this was left by a
# process that died mid-write; a younger one is another process's, about to be renamed.
STALE_TEMP_S = 60.0


class _File(NamedTuple):
    mtime: float
    size: int
    path: str
    tenant: str  # its tenant's hash, the head of its name


class FolderStore(ResponseStore):
    """One file per entry in `folder`, shared by the `processes` gateway processes of one
    gateway, each with a store of its own over it.

    An entry's file is named by hashes of its tenant and of its tenant and id (a name no
    request can steer out of the folder, another tenant's id names another file, and the
    files of one tenant are known by name), holds both (checked as it is read: a 404 either
    way), is written under a temporary name and renamed (a reader sees it whole or not at
    all), readable by this user alone (0600, in the folder's 0700), and its modification
    time is when it was stored: one clock, the wall clock, for every process.

    Age holds exactly: an entry is found only while younger than `max_age_s`. Bytes hold
    within 1/OVERSHOOT: rather than a scan of the folder at every write, each process looks
    over it once it has written max_bytes / (OVERSHOOT x processes) since it last did,
    removing what is past its age, then (the interface's policy) the oldest of the tenant
    holding the most, until the files' bytes are within max_bytes. So between its looks
    each process adds less than that share (and its last entry), and the folder holds at
    most about max_bytes x (1 + 1/OVERSHOOT). A look is a directory scan (at 64 MiB of 5 KB
    entries, 13,000 files, tens of milliseconds), on a thread: once every 2 MiB a process
    stores, with 4 processes. An expired entry's file stays until a look, within that
    bound. A look leaves temporary files alone (another process is writing them) unless
    they are older than STALE_TEMP_S (left by a process that died mid-write).
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
        return sum(f.size for f in self._files())

    def __len__(self) -> int:
        return sum(1 for _ in self._files())

    def put(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        """Writes the entry, then looks over the folder if it is time (at once, here)."""
        if not self._wrote(self._write(tenant, response, messages)):
            return False
        if self._look_due():
            self._evict()
        return True

    async def store(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> bool:
        """The write on a thread, awaited (the entry is there before the answer's end is
        sent); a look that falls due on another thread, not awaited (tens of milliseconds
        that this answer need not wait)."""
        if not self._wrote(await asyncio.to_thread(self._write, tenant, response, messages)):
            return False
        if self._look_due():
            self._looking = True
            asyncio.get_running_loop().run_in_executor(None, self._evict).add_done_callback(self._looked)
        return True

    async def fetch(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self.get, tenant, response_id)

    def _write(self, tenant: str, response: dict, messages: Sequence[ChatMessage]) -> int:
        """The entry's file written whole; its bytes (0: not kept)."""
        data = encode(tenant, response, messages)
        if self.too_big(response, len(data)):
            return 0
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
            return 0
        return len(data)

    def _wrote(self, size: int) -> bool:
        """Counts a write's bytes towards the next look (on the caller's thread); whether it was kept."""
        self._written += size
        return size > 0

    def _look_due(self) -> bool:
        if self._written < self._look_every or self._looking:
            return False
        self._written = 0
        return True

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
        return self.folder / f"{_hash(tenant)[:16]}-{_hash([tenant, response_id])}.json"

    def _files(self, stale_temps: list[str] | None = None) -> Iterator[_File]:
        """The entries' files in the folder; temporary ones (writes under way) are left out,
        those older than STALE_TEMP_S added to `stale_temps` when it is given."""
        stale_before = self._clock() - STALE_TEMP_S
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed meanwhile, by another process's look or rename
                    continue
                if entry.name.startswith("."):
                    if stale_temps is not None and st.st_mtime < stale_before:
                        stale_temps.append(entry.path)
                    continue
                yield _File(st.st_mtime, st.st_size, entry.path, entry.name.partition("-")[0])

    def _evict(self) -> None:
        """What is past its age, then the oldest of the tenant holding the most bytes until
        the folder is within max_bytes; and temporary files left by a process that died."""
        oldest_kept = self._clock() - self.max_age_s
        stale: list[str] = []
        by_tenant: dict[str, list[_File]] = {}
        for f in self._files(stale):
            if f.mtime < oldest_kept:
                stale.append(f.path)
            else:
                by_tenant.setdefault(f.tenant, []).append(f)
        for path in stale:
            _remove(path)
        held = {tenant: sum(f.size for f in files) for tenant, files in by_tenant.items()}
        total = sum(held.values())
        for files in by_tenant.values():
            files.sort(reverse=True)  # newest first: the oldest pops off the end
        while total > self.max_bytes:
            tenant = max(held, key=held.__getitem__)
            f = by_tenant[tenant].pop()
            _remove(f.path)
            held[tenant] -= f.size
            total -= f.size
            if not by_tenant[tenant]:
                del by_tenant[tenant], held[tenant]


def _hash(key) -> str:
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # another process's look removed it first
        pass
