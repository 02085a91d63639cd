"""The controller's health decisions, apart from the Ray and gRPC calls that feed them
(deploy/health_rounds.py).

Each round, for each worker not draining: what its host reported (or that the host could
not be reached) and, for a live worker of the known incarnation, its deep-health answer,
become one decision. Only a wedged or silent worker (`unhealthy_after` failed checks in a
row) or a dead process is replaced; a slow, busy one is kept (engine/liveness judges it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deploy.slot import HostReport, Slot
from worker.exit_codes import describe


class Action(enum.Enum):
    NONE = "none"  # nothing to do this round
    HOST_LOST = "host lost"  # the actor is gone: Ray restarts it; out of the membership meanwhile
    WAIT = "wait"  # a new incarnation is starting
    ADOPT = "adopt"  # a new incarnation serves: it replaces the old in the membership
    RESTORE_ROLE = "restore role"  # a new incarnation serves the role it was first placed with, not its pool's
    RESTART = "restart"  # kill the host; Ray starts a fresh one
    CHECK = "check"  # alive and known: ask its deep health


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str = ""


def judge_report(slot: Slot, report: HostReport | None) -> Decision:
    """From the host's report alone (None: the actor could not be reached)."""
    if report is None:
        return Decision(Action.HOST_LOST)
    if report.incarnation != slot.incarnation:  # a restarted host: a new process
        if report.address and report.role and (report.role, report.worker_id) != (slot.role, slot.worker_id):
            # it had moved pools (deploy/role_change.py): it starts as what it was placed as
            return Decision(Action.RESTORE_ROLE, f"its restarted host serves as {report.role} worker {report.worker_id}")
        if report.address:
            return Decision(Action.ADOPT)
        if not report.alive:
            return Decision(Action.RESTART, f"its new process exited ({describe(report.exit_code)})")  # died too
        return Decision(Action.WAIT)
    if not report.alive:
        return Decision(Action.RESTART, f"its process exited ({describe(report.exit_code)})")
    return Decision(Action.CHECK)


def judge_health(failures_in_a_row: int, unhealthy_after: int) -> Decision:
    """After a failed deep check: replace the worker only at `unhealthy_after` in a row."""
    if failures_in_a_row >= unhealthy_after:
        return Decision(Action.RESTART, f"failed deep health {failures_in_a_row} times in a row")
    return Decision(Action.NONE)
