"""Tenant counts shared by the processes of one gateway (`python -m gateway --processes N`).

One file, mapped into every process: a row per tenant, a column per process, and in each
cell two int64s, the sequences and the queued tokens that process has admitted for that
tenant. A process writes only its own column. An admit locks the tenant's row (an fcntl
record lock on its bytes), sums the row, checks the tenant's limits against the sums and
adds to its own column, so the limits hold exactly across the processes: no two of them
can both take a tenant's last slot. A release subtracts from its own column under the same
lock. A process that dies leaves its column behind, and the front process
(gateway/processes.py) zeroes it before the process's replacement starts, so a crash leaks
no slot; an fcntl lock dies with its holder, so a crash inside an admit blocks no one.

    table = TenantTable.create(path, rows=3, processes=2)    # the front process, before any child
    row = TenantTable.open(path, 3, 2, process=0).row(1)     # child 0, for its tenant 1
    with row.locked():
        in_flight, tokens = row.totals()
        ...
        row.add(choices, tokens)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

CELL = 2  # int64s per (tenant, process): sequences, queued tokens
WORD = 8  # bytes per int64


class TenantRow:
    """One tenant's row, as one process sees it: the sums over every process, its own cell."""

    def __init__(self, table: TenantTable, row: int):
        self.table, self.row = table, row
        self._first = row * table.processes * CELL  # its first int64
        self._own = self._first + table.process * CELL

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """This row to this process alone (blocking; the others hold it for a few loads and stores)."""
        with self.table.lock(self.row):
            yield

    def totals(self) -> tuple[int, int]:
        """(sequences, queued tokens) summed over every process. Exact under `locked()`;
        without it an aligned read of each cell, which a check ahead of the locked one may use."""
        words = self.table.words
        cells = words[self._first:self._first + self.table.processes * CELL]
        return sum(cells[0::2]), sum(cells[1::2])

    def add(self, sequences: int, tokens: int) -> None:
        """To this process's own cell (negative: a release); call under `locked()`."""
        words = self.table.words
        words[self._own] += sequences
        words[self._own + 1] += tokens


class TenantTable:
    """The mapped file of `rows` tenants x `processes` columns; `process`: whose column is ours
    (-1 in the front process, which owns no column and only zeroes a dead child's)."""

    def __init__(self, path: Path, rows: int, processes: int, process: int):
        self.path, self.rows, self.processes, self.process = Path(path), rows, processes, process
        self._fd = os.open(self.path, os.O_RDWR)
        size = rows * processes * CELL * WORD
        actual = os.fstat(self._fd).st_size
        if actual != size:
            os.close(self._fd)
            raise ValueError(f"{path}: {actual} bytes, not the {size} of {rows} tenants x {processes} processes")
        self._map = mmap.mmap(self._fd, size)
        self.words = memoryview(self._map).cast("q")  # aligned int64 loads and stores

    @classmethod
    def create(cls, path: Path, rows: int, processes: int) -> TenantTable:
        """A zeroed table, private to its owner (0600); the front process's handle."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, rows * processes * CELL * WORD)
        finally:
            os.close(fd)
        return cls(path, rows, processes, -1)

    @classmethod
    def open(cls, path: Path, rows: int, processes: int, process: int) -> TenantTable:
        """A child's handle: its column is `process`."""
        if not 0 <= process < processes:
            raise ValueError(f"process {process} of {processes}")
        return cls(path, rows, processes, process)

    def row(self, row: int) -> TenantRow:
        if not 0 <= row < self.rows:
            raise ValueError(f"tenant row {row} of {self.rows}")
        return TenantRow(self, row)

    @contextlib.contextmanager
    def lock(self, row: int) -> Iterator[None]:
        length = self.processes * CELL * WORD
        fcntl.lockf(self._fd, fcntl.LOCK_EX, length, row * length)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, length, row * length)

    def zero_column(self, process: int) -> None:
        """A dead process's counts gone, row by row under each row's lock: what it held is free."""
        for row in range(self.rows):
            with self.lock(row):
                first = (row * self.processes + process) * CELL
                self.words[first] = self.words[first + 1] = 0

    def close(self) -> None:
        self.words.release()
        self._map.close()
        os.close(self._fd)
