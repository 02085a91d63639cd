"""Receiver side: which requests are waiting for KV, and what their notifications say.

    receiver.expect("req-1", sender="prefill-0-2", timeout_s=30)
    for event in receiver.poll(): ...   # every engine step: COMPLETE, ABORTED or TIMED_OUT

A notification may arrive before `expect` (the writer was fast): it is kept and matched
when `expect` comes. A writer that dies mid-push never notifies; its requests end as
TIMED_OUT at their deadline, which bounds how long blocks stay reserved.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from transfer.agent import TransferAgent
from transfer.messages import NotifKind, Notification

log = logging.getLogger(__name__)

_EARLY_NOTIFICATION_TTL_S = 600.0
# Notifications nobody expects yet, kept at most this many (the oldest go first): any agent
# that reaches this one can send them, so they must not pile up without bound.
MAX_EARLY_NOTIFICATIONS = 4096


class ReceiveStatus(enum.Enum):
    COMPLETE = "complete"  # every block of the request has landed
    ABORTED = "aborted"  # the writer stopped and has nothing in flight
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class ReceiveEvent:
    request_id: str
    status: ReceiveStatus
    sender: str
    num_blocks: int = 0


@dataclass
class _Expected:
    sender: str | None
    deadline: float


class KVReceiver:
    def __init__(self, agent: TransferAgent, default_timeout_s: float = 30.0):
        self.agent = agent
        self.default_timeout_s = default_timeout_s
        self._expected: dict[str, _Expected] = {}
        self._early: dict[str, tuple[Notification, float]] = {}

    def expect(self, request_id: str, sender: str | None = None, timeout_s: float | None = None) -> None:
        """Wait for `request_id`'s KV (from `sender`, or any peer when None)."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        self._expected[request_id] = _Expected(sender, time.monotonic() + timeout)

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._early.pop(request_id, None)

    def progress(self) -> None:
        """Take in new notifications (matched by the next `poll`) and drive NIXL's progress,
        which a writer's completion waits on; cheap enough to call often, e.g. during a step."""
        now = time.monotonic()
        for notif in self.agent.poll_notifications():
            self._early.pop(notif.request_id, None)  # re-inserted last: the dict's order is arrival order
            self._early[notif.request_id] = (notif, now)
            if len(self._early) > MAX_EARLY_NOTIFICATIONS:
                oldest = next(iter(self._early))
                del self._early[oldest]
                log.warning("more than %d unexpected KV notifications; dropped the oldest (request %s)",
                            MAX_EARLY_NOTIFICATIONS, oldest)

    def poll(self) -> list[ReceiveEvent]:
        now = time.monotonic()
        self.progress()
        events = []
        for rid in [r for r in self._expected if r in self._early]:
            notif, _ = self._early.pop(rid)
            exp = self._expected[rid]
            if exp.sender is not None and notif.sender != exp.sender:
                log.warning("request %s: notification from %s, expected %s; ignored", rid, notif.sender, exp.sender)
                continue
            del self._expected[rid]
            status = ReceiveStatus.COMPLETE if notif.kind is NotifKind.DONE else ReceiveStatus.ABORTED
            events.append(ReceiveEvent(rid, status, notif.sender, notif.num_blocks))
        for rid, exp in list(self._expected.items()):
            if now > exp.deadline:
                del self._expected[rid]
                log.info("request %s: no KV from %s before the deadline", rid, exp.sender or "any peer")
                events.append(ReceiveEvent(rid, ReceiveStatus.TIMED_OUT, exp.sender or ""))
        for rid, (_, t) in list(self._early.items()):  # notifications nobody asked for
            if now - t > _EARLY_NOTIFICATION_TTL_S:
                del self._early[rid]
        return events
