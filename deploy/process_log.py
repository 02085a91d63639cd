"""A hosted process's log: a private file on its node, rotated by size.

Logs hold request ids, prompts' sizes and worker addresses: they live under the user's own
cache folder (`PDSERVE_LOG_DIR` moves them), in folders only the owner can enter (0700)
and files only the owner can read (0600), never in a shared temp folder where anyone can
read them or plant a file of the same name first. The child's output goes through a pipe
to a thread that writes it, so a long-running worker's log never grows past
`max_bytes` times (backups + 1).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

from common import envs

MAX_BYTES = 64 << 20
BACKUPS = 2


def log_root() -> Path:
    """PDSERVE_LOG_DIR, else <cache dir>/logs (common/envs.py)."""
    return envs.log_dir()


def private_dir(path: Path) -> Path:
    """`path`, and each missing parent, made owner-only (existing parents are left as they are)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
        os.chmod(p, 0o700)  # mkdir's mode is masked by the umask
    os.chmod(path, 0o700)
    return path


class RotatingLog:
    """Copies a stream (the child's stdout) into `path` line by line, from a thread of its own."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS):
        private_dir(path.parent)
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._file = self._open()

    def _open(self) -> BinaryIO:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab", buffering=0)

    def write(self, data: bytes) -> None:
        if self._file.tell() + len(data) > self.max_bytes and self._file.tell() > 0:
            self._rotate()
        self._file.write(data)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            newer = self.path.with_name(f"{self.path.name}.{i - 1}") if i > 1 else self.path
            if newer.exists():
                os.replace(newer, older)
        self._file = self._open()

    def follow(self, stream: BinaryIO) -> threading.Thread:
        """Copy `stream` until it ends (the child exited), then close the file."""
        def run() -> None:
            try:
                for line in iter(stream.readline, b""):
                    self.write(line)
            finally:
                self._file.close()

        thread = threading.Thread(target=run, name=f"log-{self.path.name}", daemon=True)
        thread.start()
        return thread
