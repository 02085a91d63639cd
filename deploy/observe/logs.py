"""The processes' log files, read back: every log under a deployment's folder, and the JSON
objects one logger wrote in them (a request's trace events, a worker's step lines)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path


def log_files(roots: Iterable[Path | str]) -> list[Path]:
    """Every log (and rotated backup) under `roots`, oldest first."""
    files = set()
    for root in map(Path, roots):
        if root.is_file():
            files.add(root)
        elif root.is_dir():
            files.update(p for p in root.rglob("*.log*") if p.is_file())
    return sorted(files, key=lambda p: p.stat().st_mtime)


def json_lines(paths: Iterable[Path], mark: str, needles: Iterable[str] = ()) -> Iterator[dict]:
    """The JSON objects logged after `mark` (" <logger name>: ") in `paths`, in file order;
    only lines holding one of `needles`, when given (a fast filter). Lines cut by rotation,
    or not JSON, are skipped."""
    needles = tuple(needles)
    for path in paths:
        try:
            f = path.open(errors="replace")
        except OSError:
            continue
        with f:
            for line in f:
                i = line.find(mark)
                if i < 0 or (needles and not any(n in line for n in needles)):
                    continue
                try:
                    yield json.loads(line[i + len(mark):])
                except ValueError:
                    continue
