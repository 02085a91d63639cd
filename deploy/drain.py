"""Draining a worker: it leaves only once it confirms it holds nothing.

The controller takes the worker out of the gateway's membership first; then this asks the
worker's `Drain` RPC, over and over: the first answer stops it taking new requests (one
routed to it just before the membership changed is refused with UNAVAILABLE and goes to
another worker: gateway/request_path.py), and each says what it still holds (open calls,
streams, remote prefills in flight, blocks waiting for an abort's confirmation:
worker/holdings.py). The drain ends when the worker says it holds nothing, a handshake,
not a settle time. What else ends it:

- the process is gone (nothing left to wait for);
- the worker is wedged: its deep health failed `unhealthy_after` checks in a row (a slow,
  busy worker passes them: its bound comes from its own step times, worker/liveness.py);
- the user's bound `drain_timeout_s`.

A Drain call that gets no answer ends nothing on its own: a worker busy enough to miss
one deadline is asked again, and its health decides.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rpc import pdserve_pb2 as pb
from worker.holdings import Holdings

log = logging.getLogger(__name__)

POLL_S = 0.2  # between two Drain calls: a request's end is seen within a fraction of a second


class DrainEnd(enum.Enum):
    EMPTY = "empty"  # the worker confirmed it holds nothing
    GONE = "gone"  # its process died
    WEDGED = "wedged"  # its deep health failed too often in a row
    BOUND = "bound"  # still busy at drain_timeout_s


@dataclass(frozen=True)
class Drained:
    end: DrainEnd
    seconds: float
    last: Holdings | None  # the worker's last answer (None: it never answered)


def holdings_of(answer: pb.DrainResponse) -> Holdings:
    return Holdings(answer.open_calls, answer.requests, answer.awaiting_kv, answer.held_blocks)


def drain(ask: Callable[[], Holdings | None], alive: Callable[[], bool], healthy: Callable[[], bool], *,
          bound_s: float, health_interval_s: float, unhealthy_after: int,
          say: Callable[[str], None] = log.info) -> Drained:
    """Ask `ask()` (the Drain RPC: Holdings, or None for no answer) until the worker holds
    nothing; `alive()` says whether its process runs, `healthy()` is a deep health check,
    run every `health_interval_s`. `say` gets a line whenever what it holds changes."""
    t0 = time.monotonic()
    last: Holdings | None = None
    checked, failures = t0, 0
    while True:
        now = time.monotonic()
        holdings = ask()
        if holdings is not None:
            if holdings != last:
                say(holdings.describe())
            last = holdings
            if holdings.empty:
                return Drained(DrainEnd.EMPTY, now - t0, last)
        elif not alive():
            return Drained(DrainEnd.GONE, now - t0, last)
        if now - t0 >= bound_s:
            return Drained(DrainEnd.BOUND, now - t0, last)
        if now - checked >= health_interval_s:
            checked = now
            failures = 0 if healthy() else failures + 1
            if failures >= unhealthy_after:
                return Drained(DrainEnd.WEDGED, now - t0, last)
        time.sleep(POLL_S)
