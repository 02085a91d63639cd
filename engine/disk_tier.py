"""The disk tier of a worker's prefix cache: KV blocks the pool evicts, kept in files on
local disk and read back on a hit instead of recomputed (docs/engine.md, Disk tier).

One file a block, under a folder named by the compatibility key (`compatibility_key`: the
model, its weights, the KV dtype and block shape), so another model's or dtype's blocks are
never read:

    name     blake2b keyed with the tier's secret of the block's chained hash (common/block_hash.py,
             salted per tenant as the pool is): a listing says nothing of whose prompts these are
    header   magic b"PDKV", version, block hash, dtype, ndim + 6 dims, payload length
    checksum blake2b keyed with the secret (16 bytes) of header + payload: a block nobody with
             the secret wrote fails it
    payload  the block's bytes, [num_layers, 2, block_size, kv_heads, head_dim]

The folders are this user's alone (engine/private_folder.py: 0700, a folder someone else owns
or may write is refused), the files 0600, and the secret (32 random bytes) a 0600 file in the
tier's root made at its first open: a restarted worker on the same folder reads its blocks
again, another local user can neither read which prompts were served nor plant a block.

A file is written to a temporary name and renamed into place (a crash leaves no half file
under a block's name). A file that fails its header or checksum check is deleted and
counted, never served. Bounded in bytes, least recently used first out (a read is a use,
and touches the file's mtime, so a restarted worker rebuilds the same order from the folder).

The engine's thread copies an evicted block out of the pool (a small CPU copy) and queues
it; one writer thread does the file I/O. A full queue drops the save (counted) rather than
make the step wait. A block still queued is served from its queued copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.private_folder import own_folder, own_secret

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 2  # 2: keyed names and checksums
SECRET_FILE = "secret"  # in the tier's root, beside the compatibility keys' folders
SUFFIX = ".kvb"
MAX_DIMS = 6
# magic, version, block hash, dtype name, ndim, dims, payload length
_HEADER = struct.Struct(f"<4sH16s12sB{MAX_DIMS}IQ")
_CHECKSUM_BYTES = 16
DEFAULT_QUEUE_BYTES = 64 << 20  # blocks copied out and waiting for the writer, at most
_FINGERPRINT_BYTES = 1 << 16  # of each weights file: its head (header, offsets) and tail


def checkpoint_fingerprint(folder: Path) -> str:
    """What tells one checkpoint's weights from another's, read cheaply: each safetensors
    file's name, size, first and last 64 KiB (the header with every tensor's offsets and
    some weights). Two checkpoints of one config but other weights differ here."""
    h = hashlib.blake2b(digest_size=16)
    for file in sorted(Path(folder).glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()


def compatibility_key(model: ModelConfig, weights: str, dtype: torch.dtype, block_size: int) -> str:
    """The folder name of the blocks this engine may read: a hash of what makes KV blocks
    interchangeable (the architecture and its config, the weights' fingerprint, the KV
    dtype, block size, layers, KV heads, head dim). The model's folder name, EOS ids and
    multi-token-prediction layers do not change the KV and are left out."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("name", "eos_token_ids", "mtp_layers")}
    what = {"model": fields, "weights": weights, "dtype": str(dtype).removeprefix("torch."),
            "block_size": block_size, "layers": model.num_layers, "kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim, "version": VERSION}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8).hexdigest()


class DiskTierStats(NamedTuple):
    bytes: int  # in files now
    entries: int  # blocks in files now
    max_bytes: int
    written: int  # blocks written since open
    loaded: int  # blocks served into the pool since open
    corrupt: int  # files that failed their header or checksum check (deleted)
    dropped: int  # saves dropped because the writer was behind
    failed_writes: int  # writes that raised (disk full, permissions)


class DiskTier:
    """Blocks of one pool tensor `[num_blocks, num_layers, 2, block_size, kv_heads,
    head_dim]` under `root / key`, at most `max_bytes` of files. Implements
    engine.lower_tier.LowerTier; `save`, `has`, `load` on the engine's thread."""

    def __init__(self, root: Path, key: str, pool: torch.Tensor, max_bytes: int,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes}: must be positive")
        self._secret = own_secret(own_folder(Path(root)) / SECRET_FILE)
        self.folder = own_folder(Path(root) / key)
        self.max_bytes = max_bytes
        self._pool: torch.Tensor | None = pool  # None once closed
        self._shape = tuple(pool.shape[1:])  # one block: [num_layers, 2, block_size, kv_heads, head_dim]
        if len(self._shape) > MAX_DIMS:
            raise ValueError(f"a block of {len(self._shape)} dims: at most {MAX_DIMS}")
        self._dtype = pool.dtype
        self._dtype_name = str(pool.dtype).removeprefix("torch.").encode()
        self._payload_bytes = pool[0].numel() * pool.element_size()
        self.file_bytes = _HEADER.size + _CHECKSUM_BYTES + self._payload_bytes
        self._read_buf = bytearray(self.file_bytes)  # the engine thread's, reused by every load
        self._lock = threading.Lock()  # the index, the pending copies, the counters
        # both by file name (`_name`), not by block hash
        self._index: OrderedDict[bytes, None] = OrderedDict()  # head = least recently used
        self._pending: dict[bytes, tuple[bytes, torch.Tensor]] = {}  # copied out, not written yet: (hash, block)
        self._written = self._loaded = self._corrupt = self._dropped = self._failed_writes = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max(1, queue_bytes // self._payload_bytes))
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- LowerTier ------------------------------------------------------------------------

    def save(self, block_hash: bytes, block_id: int) -> None:
        name = self._name(block_hash)
        with self._lock:
            if name in self._index:  # kept already (it came from here): evicted again is a use
                self._index.move_to_end(name)
                return
            if name in self._pending:
                return
            if self._queue.full():  # only this thread puts: still full at put_nowait
                self._dropped += 1
                return
            self._pending[name] = (block_hash, self._pool[block_id].to("cpu", copy=True))
        self._queue.put_nowait(name)

    def has(self, block_hash: bytes) -> bool:
        name = self._name(block_hash)
        with self._lock:
            return name in self._index or name in self._pending

    def load(self, block_hash: bytes, block_id: int) -> bool:
        name = self._name(block_hash)
        with self._lock:
            queued = self._pending.get(name)
            if queued is not None:
                self._pool[block_id].copy_(queued[1])
                self._loaded += 1
                return True
            if name not in self._index:
                return False
            self._index.move_to_end(name)
        path = self._path(name)
        try:  # outside the lock: the writer may evict it meanwhile (a miss then)
            with open(path, "rb") as f:
                n = f.readinto(self._read_buf)
                extra = f.read(1)
            os.utime(path)  # the LRU order survives a restart
        except FileNotFoundError:
            self._forget(name)
            return False
        except OSError as e:
            log.warning("disk tier: cannot read %s: %s", path, e)
            self._forget(name)
            return False
        problem = self._check(self._read_buf, n, extra, block_hash)
        if problem is not None:
            self._drop_corrupt(path, name, problem)
            return False
        src = torch.frombuffer(self._read_buf, dtype=torch.uint8, count=self._payload_bytes,
                               offset=_HEADER.size + _CHECKSUM_BYTES)
        self._pool[block_id].copy_(src.view(self._dtype).view(self._shape))
        with self._lock:
            self._loaded += 1
        return True

    # -- the rest -------------------------------------------------------------------------

    def stats(self) -> DiskTierStats:
        """A snapshot (any thread)."""
        with self._lock:
            n = len(self._index)
            return DiskTierStats(n * self.file_bytes, n, self.max_bytes, self._written, self._loaded,
                                 self._corrupt, self._dropped, self._failed_writes)

    def flush(self) -> None:
        """Wait until every queued save is written (tests; a clean close)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (bounded), and let go of the pool (a
        role change frees it before making the next one). No save or load after this."""
        if self._writer.is_alive():
            try:
                self._queue.put(None, timeout=30.0)
            except queue.Full:  # the writer is stuck: it is a daemon thread, left behind
                log.warning("disk tier: the writer did not take its stop in 30 s; closing without it")
            else:
                self._writer.join(30.0)
        self._pool = None

    def path_of(self, block_hash: bytes) -> Path:
        """The file a block is kept in (whether or not it is there)."""
        return self._path(self._name(block_hash))

    def _name(self, block_hash: bytes) -> bytes:
        """A block's file name: its hash keyed with the secret (nothing to guess it by)."""
        return hashlib.blake2b(block_hash, key=self._secret, digest_size=16).digest()

    def _path(self, name: bytes) -> Path:
        return self.folder / f"{name.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the index from the folder, least recently used first (mtime); remove what
        a killed writer left half-written and files of the wrong size (counted corrupt)."""
        found: list[tuple[float, bytes]] = []
        for path in self.folder.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                name = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            if len(name) != 16:
                continue
            if st.st_size != self.file_bytes:
                self._drop_corrupt(path, name, f"{st.st_size} bytes, not {self.file_bytes}")
                continue
            found.append((st.st_mtime, name))
        for _, name in sorted(found):
            self._index[name] = None
        victims = self._over_bound()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)
        s = self.stats()
        log.info("disk tier: %s, at most %.2f GiB: found %d blocks (%.1f MiB)%s", self.folder,
                 self.max_bytes / 2**30, s.entries, s.bytes / 2**20,
                 f", {len(victims)} over the bound removed" if victims else "")

    def _check(self, buf: bytearray, n: int, extra: bytes, block_hash: bytes) -> str | None:
        """What is wrong with a file read into `buf` (`n` bytes, `extra` past them), or None."""
        if n != self.file_bytes or extra:
            return f"{n + len(extra)}{'+' if extra else ''} bytes, not {self.file_bytes}"
        magic, version, stored_hash, dtype, ndim, *rest = _HEADER.unpack_from(buf)
        dims, payload_len = tuple(rest[:ndim]), rest[-1]
        if magic != MAGIC or version != VERSION:
            return f"magic {magic!r} version {version}, not {MAGIC!r} {VERSION}"
        if stored_hash != block_hash:
            return "the header names another block"
        if dtype.rstrip(b"\0") != self._dtype_name or dims != self._shape or payload_len != self._payload_bytes:
            name = dtype.rstrip(b"\0").decode(errors="replace")
            return f"a block of {name} {dims}, not {self._dtype} {self._shape}"
        view = memoryview(buf)
        h = hashlib.blake2b(view[:_HEADER.size], key=self._secret, digest_size=_CHECKSUM_BYTES)
        h.update(view[_HEADER.size + _CHECKSUM_BYTES:])
        if h.digest() != view[_HEADER.size:_HEADER.size + _CHECKSUM_BYTES]:
            return "checksum mismatch"
        return None

    def _drop_corrupt(self, path: Path, name: bytes, problem: str) -> None:
        log.warning("disk tier: %s fails its check (%s): deleted, its block is recomputed", path.name, problem)
        path.unlink(missing_ok=True)
        self._forget(name)
        with self._lock:
            self._corrupt += 1

    def _forget(self, name: bytes) -> None:
        with self._lock:
            self._index.pop(name, None)

    def _over_bound(self) -> list[bytes]:
        """Take least recently used entries out of the index until it fits (lock held or
        not yet shared); returns them for their files to be removed."""
        victims = []
        while self._index and len(self._index) * self.file_bytes > self.max_bytes:
            victims.append(self._index.popitem(last=False)[0])
        return victims

    def _write_loop(self) -> None:
        while True:
            name = self._queue.get()
            try:
                if name is None:
                    return
                self._write_one(name)
            finally:
                self._queue.task_done()

    def _write_one(self, name: bytes) -> None:
        with self._lock:
            pending = self._pending.get(name)
        if pending is None:
            return
        if self.file_bytes > self.max_bytes:  # one block over the bound: nothing can be kept
            with self._lock:
                self._pending.pop(name, None)
            return
        path = self._path(name)
        try:
            self._write_file(path, *pending)
        except Exception as e:  # a full disk, or anything else: the writer goes on, the block is not kept
            with self._lock:
                self._pending.pop(name, None)
                self._failed_writes += 1
                first = self._failed_writes == 1
            if first:
                log.warning("disk tier: cannot write %s: %s (further failures counted only)", path, e)
            return
        with self._lock:
            self._pending.pop(name, None)
            self._index[name] = None
            self._written += 1
            victims = self._over_bound()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _write_file(self, path: Path, block_hash: bytes, block: torch.Tensor) -> None:
        """Header, checksum, payload to a temporary file renamed into place."""
        dims = list(self._shape) + [0] * (MAX_DIMS - len(self._shape))
        header = _HEADER.pack(MAGIC, VERSION, block_hash, self._dtype_name, len(self._shape), *dims,
                              self._payload_bytes)
        payload = block.contiguous().view(-1).view(torch.uint8).numpy()
        h = hashlib.blake2b(header, key=self._secret, digest_size=_CHECKSUM_BYTES)
        h.update(payload)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
                f.write(header)
                f.write(h.digest())
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
