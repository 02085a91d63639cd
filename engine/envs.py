"""Every environment variable pdserve reads, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """PDSERVE_CACHE_DIR: where converted models live (default ~/.cache/pdserve)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


FAULT_STALL_FILE = "PDSERVE_FAULT_STALL_FILE"


def fault_stall_file() -> Path | None:
    """PDSERVE_FAULT_STALL_FILE: fault injection for tests and chaos runs. While this file
    exists and is empty, or names the worker (`decode-0-<incarnation>`, whitespace-separated
    names), the worker's engine loop stalls (its gRPC server keeps answering), like a wedged
    worker. So one variable set for a whole deployment can wedge one chosen worker. Unset in
    production."""
    value = os.environ.get(FAULT_STALL_FILE)
    return Path(value) if value else None


FAULT_TRANSFER_FILE = "PDSERVE_FAULT_TRANSFER_FILE"


def fault_transfer_file() -> Path | None:
    """PDSERVE_FAULT_TRANSFER_FILE: fault injection for tests and chaos runs. While this file
    exists, KV pushes follow what it says (transfer/faults.py): `delay_s=2` posts every
    write that much later (a slow link; `delay_s=inf`: a stuck one), `error_rate=0.5` fails
    that share of writes as a broken link would, `only=prefill-0` limits it to that worker
    (any incarnation). Unset in production."""
    value = os.environ.get(FAULT_TRANSFER_FILE)
    return Path(value) if value else None
