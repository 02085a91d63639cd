"""The exit codes a worker process ends with on purpose, and what each means to whoever
reports on it (the deployment's controller names it when it replaces the worker)."""

from __future__ import annotations

RANK_LOST = 70  # a tensor-parallel rank of this worker died: the group is replaced as a whole

_MEANING = {RANK_LOST: "a tensor-parallel rank of the worker died"}


def describe(code: int | None) -> str:
    """'code 70: a tensor-parallel rank of the worker died', 'killed by signal 9', 'code 1'."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        return f"killed by signal {-code}"
    meaning = _MEANING.get(code)
    return f"code {code}: {meaning}" if meaning else f"code {code}"
