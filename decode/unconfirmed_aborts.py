"""Aborts of remote prefill attempts: what counts as an answer, and the blocks set aside
(quarantined) when none comes in time.

decode/remote_prefill.py aborts an attempt that failed while its prefill worker may still be
writing (the Abort RPC) and holds the request's blocks until the worker confirms nothing of
it is in flight or is proven gone (worker/peers.py). A prefill worker that does
neither within `abort_bound_s` costs the bound and some blocks, never a hung request: the
blocks are set aside here under a quarantine id of their own (a `Quarantined` event: the
engine holds them out of use) and the request goes on without them. The Abort is asked
again until it is answered, or the worker leaves the deployment's membership; then the
blocks are `Released`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from decode.remote_prefill_events import Quarantined, Released
from decode.remote_prefill_state import RemotePrefillState
from worker.peers import ABORT_RETRY_S, KVPeers, abort_answered

log = logging.getLogger(__name__)

DEFAULT_ABORT_BOUND_S = 30.0  # unconfirmed this long: the request goes on without its blocks




@dataclass
class Unconfirmed:
    """Quarantined blocks, and the abort that will free them once answered."""

    quarantine_id: str
    request_id: str
    worker: str
    abort_rpc: grpc.Future | None
    retry_at: float = 0.0


class UnconfirmedAborts:
    """The blocks set aside by one decode worker (its loop thread), by quarantine id.
    `ask_abort(worker, request_id)` sends one Abort."""

    def __init__(self, peers: KVPeers, ask_abort: Callable[[str, str], grpc.Future]):
        self.peers = peers
        self.ask_abort = ask_abort
        self.set_aside: dict[str, Unconfirmed] = {}

    def quarantine(self, state: RemotePrefillState, abort_bound_s: float) -> Quarantined:
        """Unconfirmed past the bound: the request's blocks are set aside (its abort, in
        flight or to be asked again, goes with them); the request itself is no longer here."""
        rid = state.request_id
        qid = f"{rid}#unconfirmed.{state.attempt}.{secrets.token_hex(2)}"
        self.set_aside[qid] = Unconfirmed(qid, rid, state.worker, state.abort_rpc, state.retry_at)
        log.warning("request %s: %s has not confirmed its abort in %.0fs; %d blocks set aside as %s, "
                    "the request goes on without them", rid, state.worker, abort_bound_s,
                    len(state.destination_blocks), qid)
        return Quarantined(rid, qid, state.cancelled)

    def poll(self) -> list[Released]:
        """Abort answers in (asked again where one failed without proof); blocks free again out."""
        released = []
        for q in list(self.set_aside.values()):
            if q.abort_rpc is None:
                if time.monotonic() >= q.retry_at:
                    q.abort_rpc = self.ask_abort(q.worker, q.request_id)
                continue
            if not q.abort_rpc.done():
                continue
            rpc, q.abort_rpc = q.abort_rpc, None
            if not abort_answered(rpc, q.request_id, q.worker, self.peers):
                q.retry_at = time.monotonic() + ABORT_RETRY_S
                continue
            released.append(self._release(q, "answered"))
        return released

    def release_gone(self) -> list[Released]:
        """After a membership change: the blocks set aside for a worker that left are free."""
        return [self._release(q, "left the deployment") for q in list(self.set_aside.values())
                if self.peers.gone(q.worker)]

    def _release(self, q: Unconfirmed, why: str) -> Released:
        del self.set_aside[q.quarantine_id]
        if q.abort_rpc is not None:
            q.abort_rpc.cancel()
        log.info("request %s: %s %s; blocks set aside as %s are free again", q.request_id, q.worker, why,
                 q.quarantine_id)
        return Released(q.quarantine_id)
