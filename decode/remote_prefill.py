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
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams
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
    reserved: RemotePrefill | None = None  # the schedule's reservation: the sequence and its blocks
    cancelled: bool = False  # the client left: once nothing is in flight, its blocks are Released

    @property
    def worker(self) -> str:
        return self.prefill_workers[self.attempt]

    @property
    def has_next_worker(self) -> bool:
        return self.attempt + 1 < len(self.prefill_workers)


def worker_is_gone(error: BaseException) -> bool:
    """A gRPC error that means the worker cannot be writing any more (dead, never reached,
    or never sent anything because it could not prove itself)."""
    return isinstance(error, NotProven) or isinstance(error, grpc.RpcError) and error.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)


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


@dataclass(frozen=True)
class PrefillHere:
    request_id: str
    reasons: list[str]


@dataclass(frozen=True)
class Released:
    request_id: str


Event = KVReady | PrefillHere | Released


class RemotePrefills:
    """Every remote prefill of one decode worker (its loop thread), keyed by request id."""

    def __init__(self, agent: TransferAgent):
        self.agent = agent
        self.receiver = KVReceiver(agent)
        self.states: dict[str, RemotePrefillState] = {}
        self._transfer_info = agent.info().to_bytes()
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self._channels_lock = threading.Lock()  # the loop and RPC threads (proving) both open them
        self._events: list[Event] = []
        self._progress_failed = False

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __getitem__(self, request_id: str) -> RemotePrefillState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    # -- commands -------------------------------------------------------------------------

    def admit(self, request_id: str, prefill_workers: list[str], deadline: float) -> None:
        """A request that will be prefilled remotely once the schedule reserves its blocks."""
        self.states[request_id] = RemotePrefillState(request_id, list(prefill_workers), [], 0, deadline)

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
                    self._events.append(PrefillHere(state.request_id, [f"{type(e).__name__}: {e}"]))
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
            else:
                self._attempt_failed(state, f"KV {ev.status.value}")
        for state in list(self.states.values()):
            self._poll(state)
        return self._take_events()

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def proven(self, addresses: list[str], timeout_s: float) -> list[str]:
        """The offered prefill workers that proved they belong to this deployment (the
        internal token goes to no other address: rpc/proof.py). Runs on the request's
        RPC thread, so the first proof to a worker, a round trip, never holds the loop; one
        that cannot prove itself or be reached now is left out of this request's choices."""
        proven = []
        for address in addresses:
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
        self._send_prefill(state, rp.seq.prompt_token_ids, rp.seq.params, rp.seq.priority, rp.seq.cache_salt)

    def _send_prefill(self, state: RemotePrefillState, prompt: list[int], params: SamplingParams,
                      priority: int, cache_salt: str) -> None:
        state.transfer_id = new_transfer_id(state.request_id, state.attempt)
        req = pb.PrefillRequest(
            request_id=state.request_id, prompt_token_ids=prompt, params=params_to_pb(params), priority=priority,
            cache_salt=cache_salt, transfer_id=state.transfer_id,
            destination=pb.KVDestination(agent_name=self.agent.name, block_ids=state.destination_blocks,
                                         num_cached_tokens=state.num_cached_tokens),
            decode_transfer_info=self._transfer_info,
        )
        timeout = max(0.1, state.deadline - time.monotonic())
        state.phase, state.kv_complete, state.first_token = Phase.PREFILLING, False, None
        state.rpc = self._stub(state.worker).Prefill.future(req, timeout=timeout)
        self.receiver.expect(state.transfer_id, timeout_s=timeout + 1.0)
        log.info("request %s: prefill on %s (attempt %d), %d blocks to fill", state.request_id, state.worker,
                 state.attempt + 1, len(state.destination_blocks))

    def _poll(self, state: RemotePrefillState) -> None:
        if state.phase is Phase.ABORTING:
            if state.abort_rpc is not None and state.abort_rpc.done():
                self._after_abort(state)
            return
        if state.rpc is not None and state.rpc.done():
            rpc, state.rpc = state.rpc, None
            try:
                resp = rpc.result()
            except grpc.RpcError as e:
                self._attempt_failed(state, f"{e.code().name}: {e.details()}", gone=worker_is_gone(e))
                return
            if resp.error.code != pb.ERROR_NONE:
                self._attempt_failed(state, resp.error.message, gone=True)  # it replied: nothing in flight
                return
            state.first_token = resp.first_token_id
            state.first_logprobs = logprobs_from_pb(resp.first_logprobs) if resp.HasField("first_logprobs") else None
            state.prefill_timings = resp.timings
        if state.kv_complete and state.first_token is not None:
            state.phase = Phase.DONE
            del self.states[state.request_id]
            self._events.append(KVReady(state.request_id, state.first_token, state.first_logprobs,
                                        state.prefill_timings, len(state.destination_blocks),
                                        state.num_cached_tokens))

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
        if state.rpc is not None:
            state.rpc.cancel()
            state.rpc = None
        state.abort_rpc = self._stub(state.worker).Abort.future(
            pb.AbortRequest(request_id=state.request_id), timeout=10.0)

    def _after_abort(self, state: RemotePrefillState) -> None:
        try:
            state.abort_rpc.result()  # confirmed: nothing of the request is in flight
        except grpc.RpcError as e:
            if not worker_is_gone(e):  # neither confirmed nor dead: keep the blocks out of use, ask again
                log.warning("request %s: %s did not confirm the abort (%s); its blocks stay reserved",
                            state.request_id, state.worker, e.code().name)
                state.abort_rpc = self._stub(state.worker).Abort.future(
                    pb.AbortRequest(request_id=state.request_id), timeout=10.0)
                return
        state.abort_rpc = None
        self._next_attempt(state)

    def _next_attempt(self, state: RemotePrefillState) -> None:
        rid = state.request_id
        if state.cancelled:  # nothing is in flight now: its blocks can go
            self.states.pop(rid, None)
            self._events.append(Released(rid))
            return
        if state.has_next_worker and time.monotonic() < state.deadline and state.reserved is not None:
            state.attempt += 1
            seq = state.reserved.seq
            self._send_prefill(state, seq.prompt_token_ids, seq.params, seq.priority, seq.cache_salt)
            return
        del self.states[rid]
        log.info("request %s: no prefill worker left (%s); prefilling locally", rid, "; ".join(state.failures))
        self._events.append(PrefillHere(rid, list(state.failures)))

    def _channel(self, address: str) -> tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]:
        with self._channels_lock:
            entry = self._channels.get(address)
            if entry is None:
                ch = auth.channel(address)
                entry = self._channels[address] = (ch, pb_grpc.PrefillWorkerStub(ch))
            return entry

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        return self._channel(address)[1]
