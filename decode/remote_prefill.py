"""The decode worker's remote prefills: one state machine per request, and the machine
that drives them all (`RemotePrefills`). Commands in (`admit`, `start`, `cancel`),
`poll() -> list[events]` out, the shape of transfer/'s pusher and receiver; the decode
worker applies the events to its engine and streams. It never touches the engine itself.

States: the Prefill RPC (a gRPC future) and the KV notification (KVReceiver) both have to
arrive before the sequence can decode. An attempt that fails while the prefill worker may
still be writing is aborted first (Abort RPC), and the next attempt starts only once that
worker confirms nothing is in flight or is known dead, so no stale write lands in blocks
that another worker is filling. Events:

- `KVReady`: the KV landed and the prefill worker sampled the first token: decode it.
- `PrefillHere`: no prefill worker is left (or none could be asked), and nothing is in
  flight: prefill it locally.
- `Released`: a cancelled request whose blocks no prefill worker can be writing any more.
- `Quarantined`: a prefill worker neither confirmed an abort nor was proven gone within
  `abort_bound_s`: the request's blocks are set aside (held, out of use) and the request
  goes on without them (prefilled here); their `Released` comes once the worker confirms
  or is proven gone. A silent host costs the bound and some blocks, never a hung request.

Membership (`set_members`, from the deploy controller's SetPeers): once known, only its
workers are asked (and proven), a worker that leaves it is gone (the controller removes a
worker only once its process ended): its aborts are not waited for any more, its set-aside
blocks are Released, and its channel is closed, so whatever later listens on its port must
prove itself afresh. Until the first list (workers started by hand) any offered worker
that proves itself is asked, and a silent one's blocks wait for its answer.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import grpc

from common import trace
from engine.scheduler import RemotePrefill
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import logprobs_from_pb, params_to_pb
from rpc.proof import NotProven
from transfer import KVReceiver, ReceiveStatus, TransferAgent

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    PREFILLING = "prefilling"  # Prefill RPC in flight, KV not complete yet
    ABORTING = "aborting"  # waiting for the failed worker to confirm no write is in flight
    DONE = "done"


@dataclass
class RemotePrefillState:
    request_id: str
    prefill_workers: list[str]
    destination_blocks: list[int]
    num_cached_tokens: int
    deadline: float  # monotonic; the gateway's deadline for the whole request
    attempt: int = 0
    transfer_id: str = ""  # the current attempt's: its KV notifications carry it (new_transfer_id)
    phase: Phase = Phase.PREFILLING
    rpc: grpc.Future | None = None
    abort_rpc: grpc.Future | None = None
    kv_complete: bool = False
    first_token: int | None = None
    first_logprobs: object = None
    prefill_timings: object = None
    started: float = field(default_factory=time.monotonic)
    failures: list[str] = field(default_factory=list)
    aborting_since: float = 0.0  # monotonic: when the current attempt's abort was first asked
    retry_at: float = 0.0  # an unconfirmed abort is asked again from then
    reserved: RemotePrefill | None = None  # the schedule's reservation: the sequence and its blocks
    kv_source: pb.KVSource | None = None  # a hand-off's: the drained decode worker (first in the list) keeps its KV
    cancelled: bool = False  # the client left: once nothing is in flight, its blocks are Released

    @property
    def worker(self) -> str:
        return self.prefill_workers[self.attempt]

    @property
    def has_next_worker(self) -> bool:
        return self.attempt + 1 < len(self.prefill_workers)


def worker_is_gone(error: BaseException) -> bool:
    """A call's error that proves the worker cannot be writing: it never sent anything (it
    could not prove itself; it does not serve prefills), or nothing listens at its address
    (connection refused: a worker closes its server only after its loop and pushes have
    stopped, or it died). UNAVAILABLE alone proves nothing: a connection that broke or a
    host gone silent may have a live worker behind it, still writing."""
    if isinstance(error, NotProven):
        return True
    if not isinstance(error, grpc.RpcError):
        return False
    return error.code() is grpc.StatusCode.UNIMPLEMENTED or (
        error.code() is grpc.StatusCode.UNAVAILABLE and "connection refused" in (error.details() or "").lower())


def new_transfer_id(request_id: str, attempt: int) -> str:
    """`request_id.attempt.nonce`: what one attempt's notifications are matched by."""
    return f"{request_id}.{attempt}.{secrets.token_hex(4)}"


def request_of(transfer_id: str) -> str:
    return transfer_id.rsplit(".", 2)[0]


@dataclass(frozen=True)
class KVReady:
    request_id: str
    first_token: int
    first_logprobs: object
    timings: pb.Timings | None
    num_blocks: int
    num_cached_tokens: int
    worker: str = ""  # the prefill worker that filled them


@dataclass(frozen=True)
class PrefillHere:
    """The request is prefilled on this worker after all. `cause` (a metric label): the
    Prefill could not be sent (`send_failed`), every offered worker failed
    (`workers_exhausted`), or its time ran out (`deadline`); `reasons` says what each try met."""

    request_id: str
    reasons: list[str]
    cause: str = "workers_exhausted"


@dataclass(frozen=True)
class Released:
    request_id: str


@dataclass(frozen=True)
class Quarantined:
    request_id: str
    quarantine_id: str  # the blocks' id until they are Released
    cancelled: bool  # the request is gone already; else it is prefilled here


@dataclass
class _Unconfirmed:
    """Quarantined blocks, and the abort that will free them once answered."""

    quarantine_id: str
    request_id: str
    worker: str
    abort_rpc: grpc.Future | None
    retry_at: float = 0.0


Event = KVReady | PrefillHere | Released | Quarantined

ABORT_TIMEOUT_S = 10.0  # one Abort call: a network bound (the prefill worker answers from its RPC thread)
ABORT_RETRY_S = 1.0  # an Abort that failed without proof is asked again after this
DEFAULT_ABORT_BOUND_S = 30.0  # unconfirmed this long: the request goes on without its blocks


class RemotePrefills:
    """Every remote prefill of one decode worker (its loop thread), keyed by request id."""

    def __init__(self, agent: TransferAgent, abort_bound_s: float = DEFAULT_ABORT_BOUND_S):
        self.agent = agent
        self.abort_bound_s = abort_bound_s
        self.receiver = KVReceiver(agent)
        self.states: dict[str, RemotePrefillState] = {}
        self.unconfirmed: dict[str, _Unconfirmed] = {}  # quarantined blocks, by quarantine id
        self._transfer_info = agent.info().to_bytes()
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self._channels_lock = threading.Lock()  # the loop and RPC threads (proving) both open them
        self._events: list[Event] = []
        self._progress_failed = False
        self.members: frozenset[str] | None = None  # the deployment's workers (SetPeers); None: not told

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __getitem__(self, request_id: str) -> RemotePrefillState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    # -- commands -------------------------------------------------------------------------

    def admit(self, request_id: str, prefill_workers: list[str], deadline: float,
              kv_source: pb.KVSource | None = None) -> None:
        """A request that will be prefilled remotely once the schedule reserves its blocks
        (with `kv_source`, first copied from the decode worker that kept its KV)."""
        self.states[request_id] = RemotePrefillState(request_id, list(prefill_workers), [], 0, deadline,
                                                     kv_source=kv_source)

    def start(self, reserved: list[RemotePrefill]) -> list[Event]:
        """Send the Prefill of each request whose blocks were just reserved. One that cannot be
        sent is prefilled locally (a PrefillHere, returned) or aborted, if its Prefill may have
        gone out, so it never strands the others or waits with its blocks reserved."""
        for rp in reserved:
            try:
                self._start(rp)
            except Exception as e:
                log.exception("request %s: starting its remote prefill failed", rp.seq.request_id)
                state = self.states.get(rp.seq.request_id)
                if state is None or state.phase is not Phase.PREFILLING:
                    continue
                if state.rpc is None:  # nothing went out: nobody can be writing its blocks
                    del self.states[state.request_id]
                    self.receiver.forget(state.transfer_id)
                    self._events.append(PrefillHere(state.request_id, [f"{type(e).__name__}: {e}"], "send_failed"))
                else:
                    self._attempt_failed(state, f"{type(e).__name__}: {e}")
        return self._take_events()

    def cancel(self, request_id: str, has_blocks: bool) -> None:
        """The request was aborted: blocks a prefill worker may still be writing are Released
        only once it confirms (or is known dead); with no blocks, nothing can be written."""
        state = self.states.get(request_id)
        if state is None:
            return
        state.cancelled = True
        if not has_blocks:
            del self.states[request_id]
        elif state.phase is Phase.PREFILLING:
            self.receiver.forget(state.transfer_id)
            self._abort_attempt(state, "cancelled")
        # ABORTING: the pending Abort confirmation releases the blocks (_next_attempt)

    def progress(self) -> None:
        """During a step (between layers): a prefill worker's push completes only when this
        side's NIXL makes progress, and its Prefill reply waits for that."""
        if not self.states:
            return
        try:
            self.receiver.progress()
        except Exception:  # a failing agent must not fail the forward pass; poll() meets it again
            if not self._progress_failed:
                log.exception("NIXL progress between layers failed")
            self._progress_failed = True

    def poll(self) -> list[Event]:
        """Notifications, RPC replies and abort confirmations in; what the worker must do out."""
        for ev in self.receiver.poll():
            state = self.states.get(request_of(ev.request_id))
            if state is None or state.phase is not Phase.PREFILLING or ev.request_id != state.transfer_id:
                continue  # an earlier attempt's (expect() only matches the current one: belt and braces)
            if ev.status is ReceiveStatus.COMPLETE:
                state.kv_complete = True
                trace.event(state.request_id, "kv_notified", attempt=state.attempt + 1)
            else:
                self._attempt_failed(state, f"KV {ev.status.value}")
        for state in list(self.states.values()):
            self._poll(state)
        for q in list(self.unconfirmed.values()):
            self._poll_unconfirmed(q)
        return self._take_events()

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def set_members(self, addresses: list[str]) -> list[Event]:
        """The deployment's workers now. Those that left are gone: nothing of theirs is
        waited for any more, and their channels close. The list takes effect at once for
        `proven` (any thread may set it); the rest runs on the loop thread."""
        members = self.members = frozenset(addresses)
        with self._channels_lock:
            left = [a for a in self._channels if a not in members]
            for address in left:
                self._channels.pop(address)[0].close()  # its calls in flight end CANCELLED
        for address in left:
            log.info("prefill peer %s left the deployment: its channel closed", address)
        for state in list(self.states.values()):
            if state.phase is Phase.ABORTING and self._gone(state.worker):
                state.abort_rpc = None
                self._next_attempt(state)
        for q in list(self.unconfirmed.values()):
            if self._gone(q.worker):
                self._release(q, "left the deployment")
        return self._take_events()

    def _gone(self, address: str, error: BaseException | None = None) -> bool:
        """Known not to be writing: out of the deployment's membership, or `error` proves it."""
        return (self.members is not None and address not in self.members) or (
            error is not None and worker_is_gone(error))

    def proven(self, addresses: list[str], timeout_s: float) -> list[str]:
        """The offered prefill workers that proved they belong to this deployment (the
        internal token goes to no other address: rpc/proof.py). Runs on the request's
        RPC thread, so the first proof to a worker, a round trip, never holds the loop; one
        that cannot prove itself or be reached now is left out of this request's choices,
        and so is one outside the membership, without a call."""
        proven = []
        members = self.members
        for address in addresses:
            if members is not None and address not in members:
                log.warning("prefill worker %s left out: not a worker of this deployment now", address)
                continue
            try:
                auth.prove(self._channel(address)[0], timeout_s)
                proven.append(address)
            except grpc.RpcError as e:
                log.warning("prefill worker %s left out: %s", address, e.details())
        return proven

    # -- one request ----------------------------------------------------------------------

    def _start(self, rp: RemotePrefill) -> None:
        state = self.states.get(rp.seq.request_id)
        if state is None or state.cancelled:
            return  # cancelled since the reservation: cancel() sent the Abort whose answer frees the blocks
        state.reserved = rp
        state.destination_blocks = rp.destination_blocks
        state.num_cached_tokens = rp.num_cached_tokens
        if self._gone(state.worker):  # it left since the request came: nothing went out to it
            state.failures.append(f"{state.worker}: left the deployment")
            self._next_attempt(state)
            return
        self._send_prefill(state, rp)

    def _send_prefill(self, state: RemotePrefillState, rp: RemotePrefill) -> None:
        """Ask the current worker to fill the reserved blocks: a prefill worker computes the
        tokens' KV, a hand-off's KV source pushes what it kept of them."""
        state.transfer_id = new_transfer_id(state.request_id, state.attempt)
        seq = rp.seq
        source = state.kv_source
        req = pb.PrefillRequest(
            request_id=state.request_id, prompt_token_ids=rp.kv_token_ids, params=params_to_pb(seq.params),
            priority=seq.priority, cache_salt=seq.cache_salt, transfer_id=state.transfer_id,
            destination=pb.KVDestination(agent_name=self.agent.name, block_ids=state.destination_blocks,
                                         num_cached_tokens=state.num_cached_tokens),
            decode_transfer_info=self._transfer_info,
            kv_request_id=source.request_id if source is not None and state.worker == source.address else "",
        )
        timeout = max(0.1, state.deadline - time.monotonic())
        state.phase, state.kv_complete, state.first_token = Phase.PREFILLING, False, None
        # Before the call: the prefill worker may log its arrival before .future() returns.
        trace.event(state.request_id, "prefill_sent", prefill_worker=state.worker, attempt=state.attempt + 1,
                    blocks=len(state.destination_blocks), cached_tokens=state.num_cached_tokens)
        state.rpc = self._stub(state.worker).Prefill.future(req, timeout=timeout)
        self.receiver.expect(state.transfer_id, timeout_s=timeout + 1.0)
        log.info("request %s: prefill on %s (attempt %d), %d blocks to fill", state.request_id, state.worker,
                 state.attempt + 1, len(state.destination_blocks))

    def _poll(self, state: RemotePrefillState) -> None:
        if state.phase is Phase.ABORTING:
            now = time.monotonic()
            if state.abort_rpc is not None and state.abort_rpc.done():
                self._after_abort(state)
            elif state.abort_rpc is None and now >= state.retry_at:
                state.abort_rpc = self._ask_abort(state.worker, state.request_id)
            if state.phase is Phase.ABORTING and now - state.aborting_since >= self.abort_bound_s:
                self._quarantine(state)
            return
        if state.rpc is not None and state.rpc.done():
            rpc, state.rpc = state.rpc, None
            try:
                resp = rpc.result()
            except grpc.RpcError as e:
                self._attempt_failed(state, f"{e.code().name}: {e.details()}", gone=self._gone(state.worker, e))
                return
            if resp.error.code != pb.ERROR_NONE:
                self._attempt_failed(state, resp.error.message, gone=True)  # it replied: nothing in flight
                return
            state.first_token = resp.first_token_id
            state.first_logprobs = logprobs_from_pb(resp.first_logprobs) if resp.HasField("first_logprobs") else None
            state.prefill_timings = resp.timings
            trace.event(state.request_id, "prefill_replied", attempt=state.attempt + 1)
        if state.kv_complete and state.first_token is not None:
            state.phase = Phase.DONE
            del self.states[state.request_id]
            self._events.append(KVReady(state.request_id, state.first_token, state.first_logprobs,
                                        state.prefill_timings, len(state.destination_blocks),
                                        state.num_cached_tokens, state.worker))

    def _attempt_failed(self, state: RemotePrefillState, reason: str, gone: bool = False) -> None:
        log.info("request %s: prefill on %s failed: %s", state.request_id, state.worker, reason)
        state.failures.append(f"{state.worker}: {reason}")
        self.receiver.forget(state.transfer_id)
        if gone:
            self._next_attempt(state)
        else:
            self._abort_attempt(state, reason)

    def _abort_attempt(self, state: RemotePrefillState, reason: str) -> None:
        """Ask the current prefill worker to stop; the blocks stay reserved until it confirms."""
        state.phase = Phase.ABORTING
        state.aborting_since = time.monotonic()
        if state.rpc is not None:
            state.rpc.cancel()
            state.rpc = None
        if self._gone(state.worker):
            self._next_attempt(state)
            return
        state.abort_rpc = self._ask_abort(state.worker, state.request_id)

    def _ask_abort(self, worker: str, request_id: str) -> grpc.Future:
        return self._stub(worker).Abort.future(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)

    def _abort_answered(self, rpc: grpc.Future, request_id: str, worker: str) -> bool:
        """The abort is confirmed (nothing of the request in flight) or the worker proven gone."""
        try:
            rpc.result()
            return True
        except grpc.RpcError as e:
            if self._gone(worker, e):
                return True
            log.warning("request %s: %s did not confirm the abort (%s: %s); its blocks stay out of use",
                        request_id, worker, e.code().name, e.details())
            return False

    def _after_abort(self, state: RemotePrefillState) -> None:
        rpc, state.abort_rpc = state.abort_rpc, None
        if not self._abort_answered(rpc, state.request_id, state.worker):
            state.retry_at = time.monotonic() + ABORT_RETRY_S  # neither confirmed nor dead: ask again
            return
        self._next_attempt(state)

    def _quarantine(self, state: RemotePrefillState) -> None:
        """Unconfirmed past the bound: the blocks are set aside, the request goes on."""
        rid = state.request_id
        qid = f"{rid}#unconfirmed.{state.attempt}.{secrets.token_hex(2)}"
        del self.states[rid]
        self.unconfirmed[qid] = _Unconfirmed(qid, rid, state.worker, state.abort_rpc, state.retry_at)
        log.warning("request %s: %s has not confirmed its abort in %.0fs; %d blocks set aside as %s, "
                    "the request goes on without them", rid, state.worker, self.abort_bound_s,
                    len(state.destination_blocks), qid)
        self._events.append(Quarantined(rid, qid, state.cancelled))

    def _poll_unconfirmed(self, q: _Unconfirmed) -> None:
        if q.abort_rpc is None:
            if time.monotonic() >= q.retry_at:
                q.abort_rpc = self._ask_abort(q.worker, q.request_id)
            return
        if not q.abort_rpc.done():
            return
        rpc, q.abort_rpc = q.abort_rpc, None
        if not self._abort_answered(rpc, q.request_id, q.worker):
            q.retry_at = time.monotonic() + ABORT_RETRY_S
            return
        self._release(q, "answered")

    def _release(self, q: _Unconfirmed, why: str) -> None:
        del self.unconfirmed[q.quarantine_id]
        if q.abort_rpc is not None:
            q.abort_rpc.cancel()
        log.info("request %s: %s %s; blocks set aside as %s are free again", q.request_id, q.worker, why,
                 q.quarantine_id)
        self._events.append(Released(q.quarantine_id))

    def _next_attempt(self, state: RemotePrefillState) -> None:
        rid = state.request_id
        if state.cancelled:  # nothing is in flight now: its blocks can go
            self.states.pop(rid, None)
            self._events.append(Released(rid))
            return
        while state.has_next_worker and time.monotonic() < state.deadline and state.reserved is not None:
            state.attempt += 1
            if self._gone(state.worker):
                state.failures.append(f"{state.worker}: left the deployment")
                continue
            self._send_prefill(state, state.reserved)
            return
        del self.states[rid]
        cause = "deadline" if time.monotonic() >= state.deadline else "workers_exhausted"
        log.info("request %s: no prefill worker left (%s); prefilling locally", rid, "; ".join(state.failures))
        self._events.append(PrefillHere(rid, list(state.failures), cause))

    def _channel(self, address: str) -> tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]:
        with self._channels_lock:
            entry = self._channels.get(address)
            if entry is None:
                ch = auth.channel(address)
                entry = self._channels[address] = (ch, pb_grpc.PrefillWorkerStub(ch))
            return entry

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        return self._channel(address)[1]
