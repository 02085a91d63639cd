"""A worker process changing role in place: the `ChangeRole` RPC's side in the worker.

A deployment moves a worker between its pools by draining it (it then holds nothing) and
asking it to become a worker of the other role. The process keeps its loaded weights; it
stops serving this role (server, engine loop, NIXL agent), builds the new role's KV pool,
scheduler and agent over the same weights, warms up and serves on a new port under its
new name (worker/process.py `main`). Nothing of the old role is carried over: to every
peer, the new worker is a new incarnation, only without the cold start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleChange:
    """What the next role of this process is (from a ChangeRoleRequest)."""

    role: str  # "prefill" or "decode"
    worker_id: str  # its id in the new pool
    incarnation: int  # its agent's name carries it: a new worker to every peer
    args: tuple[str, ...]  # the new role's flags, as `python -m <role>` takes them


class RoleChanges:
    """Takes at most one role change for the role being served, once the worker is drained
    and holds nothing; `wake` is set when one is accepted (the process's serve loop ends the
    role then)."""

    def __init__(self, worker, wake: threading.Event):
        self.worker = worker  # an EngineLoop: `closing`, `drain`, `name`, `engine`
        self.wake = wake
        self.accepted: RoleChange | None = None
        self._lock = threading.Lock()

    def ask(self, change: RoleChange) -> str:
        """"" when accepted, else why not (any gRPC thread)."""
        if change.role not in ROLES:
            return f"unknown role {change.role!r}: one of {', '.join(ROLES)}"
        if not change.worker_id:
            return "the new worker needs a worker id"
        if self.worker.engine.ranks is not None:
            return f"{self.worker.name} is tensor-parallel: its ranks' weights cannot change role in place"
        if not self.worker.closing:
            return f"{self.worker.name} takes requests: drain it first (Drain), then change its role"
        try:
            holdings = self.worker.drain()
        except TimeoutError:
            return f"{self.worker.name}: the engine loop did not answer"
        if not holdings.empty:
            return f"{self.worker.name} still {holdings.describe()}: its role changes once it holds nothing"
        with self._lock:
            if self.accepted is not None:
                return f"{self.worker.name} is already becoming {self.accepted.role} worker {self.accepted.worker_id}"
            self.accepted = change
        self.wake.set()
        return ""
