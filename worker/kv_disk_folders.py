"""A node's disk tier folders: `<--kv-disk-dir>/<role>-<worker id>/`, one per worker.

A worker claims its folder for as long as it runs (an exclusive lock on `.lock` in it: a
second worker given the same role and id on the node is refused), and a killed worker's
lock goes with its process, so a restarted one (same role and id) finds its blocks again.

Each new worker id (scale-out, a replacement, a pool move) makes a new folder of up to
`--kv-disk-gib`, so at start a worker reclaims the folders of workers that are gone (no
process holds their lock): those unused for RECLAIM_UNUSED_S, then the least recently used
until what gone workers leave adds up to at most one worker's bound. The node's tier is so
bounded by (workers running + 1) x `--kv-disk-gib`, and a worker being restarted right now
(the most recently used gone folder) keeps its blocks.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from engine.private_folder import own_folder

log = logging.getLogger(__name__)

LOCK = ".lock"
RECLAIM_UNUSED_S = 3600.0  # a gone worker's folder unused this long goes whatever its size
_WORKER_FOLDER = re.compile(r"(prefill|decode)-[A-Za-z0-9_.]+")
_held: dict[Path, int] = {}  # this process's claimed folders -> their lock's descriptor


class InUse(RuntimeError):
    """Another running worker holds the folder."""


def claim(folder: Path) -> None:
    """Make `folder` this process's (engine/private_folder.py) and hold its lock until the
    process ends. InUse when another process holds it."""
    folder = own_folder(Path(os.path.abspath(folder)))
    if folder in _held:
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InUse(f"{folder} is in use by another running worker (same role and worker id on this node): "
                    "give each worker its own --worker-id") from None
    os.utime(folder / LOCK)  # used now
    _held[folder] = fd


class GoneFolder(NamedTuple):
    path: Path
    last_used: float  # the newest mtime in it
    size: int  # bytes


def reclaim(root: Path, keep_bytes: int, now: float) -> list[GoneFolder]:
    """Remove gone workers' folders under `root` as described above; returns what went."""
    gone = sorted(_gone(Path(os.path.abspath(root))), key=lambda g: g.last_used)
    removed = [g for g in gone if now - g.last_used > RECLAIM_UNUSED_S]
    kept = [g for g in gone if g not in removed]
    while kept and sum(g.size for g in kept) > keep_bytes:
        removed.append(kept.pop(0))  # the least recently used first
    for g in removed:
        shutil.rmtree(g.path, ignore_errors=True)
        log.info("disk tier: %s (%.1f MiB, unused for %.0f s) belonged to a worker that is gone: removed", g.path,
                 g.size / 2**20, now - g.last_used)
    return removed


def _gone(root: Path) -> list[GoneFolder]:
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        path = Path(entry.path)
        if path in _held or not _WORKER_FOLDER.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(path):
            continue  # someone else's, or a running worker's
        last, size = _usage(path)
        out.append(GoneFolder(path, last, size))
    return out


def _alive(folder: Path) -> bool:
    """Whether a process holds the folder's lock (a worker without one ran before locks: gone)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return False


def _usage(folder: Path) -> tuple[float, int]:
    last, size = folder.stat().st_mtime, 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
            except OSError:
                continue
            last, size = max(last, st.st_mtime), size + st.st_size
    return last, size
