"""The decode worker's remote prefills: `RemotePrefills` drives every request's attempts
(decode/remote_prefill_state.py) on the worker's loop thread. Commands in (`admit`, `start`,
`cancel`, `set_members`), `poll() -> list[events]` out (decode/remote_prefill_events.py),
the shape of transfer/'s pusher and receiver; the decode worker applies the events to its
engine and streams. It never touches the engine itself.

Each attempt asks one prefill worker (worker/peers.py: only members of the
deployment, each proven before it is offered) to fill the reserved blocks, and waits for
both its Prefill reply and its KV notification (KVReceiver). An attempt that fails while
the prefill worker may still be writing is aborted first (Abort RPC), and the next attempt
starts only once that worker confirms nothing is in flight or is known gone, so no stale
write lands in blocks that another worker is filling; an abort unconfirmed past
`abort_bound_s` sets the blocks aside and the request goes on without them
(decode/unconfirmed_aborts.py). With no worker left, or its time up, the request is
prefilled here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from common import trace
from decode.remote_prefill_events import Event, KVReady, PrefillHere, Released
from decode.remote_prefill_state import Phase, RemotePrefillState
from decode.unconfirmed_aborts import DEFAULT_ABORT_BOUND_S, UnconfirmedAborts
from engine.scheduler import RemotePrefill
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import logprobs_from_pb, params_to_pb
from transfer import KVReceiver, ReceiveEvent, ReceiveStatus, TransferAgent
from worker.peers import ABORT_RETRY_S, ABORT_TIMEOUT_S, KVPeers, abort_answered, new_transfer_id, request_of

log = logging.getLogger(__name__)


class RemotePrefills:
    """Every remote prefill of one decode worker (its loop thread), keyed by request id."""

    def __init__(self, agent: TransferAgent, abort_bound_s: float = DEFAULT_ABORT_BOUND_S,
                 address: Callable[[], str] = lambda: ""):
        self.agent = agent
        self.address = address  # this worker's gRPC address (empty until bound): a Prefill's kv_holder
        self.abort_bound_s = abort_bound_s
        self.receiver = KVReceiver(agent)
        self.states: dict[str, RemotePrefillState] = {}
        self.peers = KVPeers()
        self.unconfirmed = UnconfirmedAborts(self.peers, self._ask_abort)  # quarantined blocks
        self._transfer_info = agent.info().to_bytes()
        self._events: list[Event] = []
        self._progress_failed = False
        # The shared receiver's notifications for this worker's other transfers (its prefix
        # fetches: worker/prefix_fetch.py); True when the hook took the event.
        self.others: Callable[[ReceiveEvent], bool] | None = None
        self.others_pending: Callable[[], bool] = lambda: False  # ... awaited now: progress between layers too

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __getitem__(self, request_id: str) -> RemotePrefillState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    @property
    def members(self) -> frozenset[str] | None:
        """The deployment's workers (SetPeers); None: not told. Any thread may set it, and
        `proven` follows it at once; `set_members` does the rest on the loop thread."""
        return self.peers.members

    @members.setter
    def members(self, addresses: frozenset[str]) -> None:
        self.peers.members = addresses

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
                    self._events.append(PrefillHere(state.request_id, [f"{type(e).__name__}: {e}"],
                                                    pb.LOCAL_PREFILL_SEND_FAILED))
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
        if not self.states and not self.others_pending():
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
            if state is None and self.others is not None and self.others(ev):
                continue
            if state is None or state.phase is not Phase.PREFILLING or ev.request_id != state.transfer_id:
                continue  # an earlier attempt's (expect() only matches the current one: belt and braces)
            if ev.status is ReceiveStatus.COMPLETE:
                state.kv_complete = True
                trace.event(state.request_id, "kv_notified", attempt=state.attempt + 1)
            else:
                self._attempt_failed(state, f"KV {ev.status.value}", transfer=True)
        for state in list(self.states.values()):
            self._poll(state)
        self._events += self.unconfirmed.poll()
        return self._take_events()

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def set_members(self, addresses: list[str]) -> list[Event]:
        """The deployment's workers now. Those that left are gone: nothing of theirs is
        waited for any more, and their channels close. The list takes effect at once for
        `proven` (any thread may set `members`); the rest runs on the loop thread."""
        self.peers.set_members(addresses)
        for state in list(self.states.values()):
            if state.phase is Phase.ABORTING and self.peers.gone(state.worker):
                state.abort_rpc = None
                self._next_attempt(state)
        self._events += self.unconfirmed.release_gone()
        return self._take_events()

    def proven(self, addresses: list[str], timeout_s: float) -> list[str]:
        """The offered prefill workers that proved they belong to this deployment (the
        request's RPC thread: worker/peers.py)."""
        return self.peers.proven(addresses, timeout_s)

    # -- one request ----------------------------------------------------------------------

    def _start(self, rp: RemotePrefill) -> None:
        state = self.states.get(rp.seq.request_id)
        if state is None or state.cancelled:
            return  # cancelled since the reservation: cancel() sent the Abort whose answer frees the blocks
        state.reserved = rp
        state.destination_blocks = rp.destination_blocks
        state.num_cached_tokens = rp.num_cached_tokens
        if self.peers.gone(state.worker):  # it left since the request came: nothing went out to it
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
        if state.num_cached_tokens and not req.kv_request_id:  # its prefill worker may fetch them from here
            req.kv_holder = self.address()
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
                del self.states[state.request_id]  # the request goes on without its blocks
                self._events.append(self.unconfirmed.quarantine(state, self.abort_bound_s))
            return
        if state.rpc is not None and state.rpc.done():
            rpc, state.rpc = state.rpc, None
            try:
                resp = rpc.result()
            except grpc.RpcError as e:
                self._attempt_failed(state, f"{e.code().name}: {e.details()}", gone=self.peers.gone(state.worker, e))
                return
            if resp.error.code != pb.ERROR_NONE:  # it replied: nothing in flight
                self._attempt_failed(state, resp.error.message, gone=True,
                                     transfer=resp.error.code == pb.KV_TRANSFER_FAILED)
                return
            state.first_token = resp.first_token_id
            state.prefill_cached_tokens = resp.num_cached_tokens
            state.first_logprobs = logprobs_from_pb(resp.first_logprobs) if resp.HasField("first_logprobs") else None
            state.prefill_timings = resp.timings
            trace.event(state.request_id, "prefill_replied", attempt=state.attempt + 1)
        if state.kv_complete and state.first_token is not None:
            state.phase = Phase.DONE
            del self.states[state.request_id]
            self._events.append(KVReady(state.request_id, state.first_token, state.first_logprobs,
                                        state.prefill_timings, len(state.destination_blocks),
                                        # prompt tokens computed nowhere: this worker's cache hits, or the
                                        # prefill worker's (any tier: memory, disk), whichever covers more
                                        max(state.num_cached_tokens, state.prefill_cached_tokens), state.worker))

    def _attempt_failed(self, state: RemotePrefillState, reason: str, gone: bool = False,
                        transfer: bool = False) -> None:
        """`transfer`: it failed in the KV's transfer (a failed write or notification), not in
        the prefill worker's call or its prefill."""
        log.info("request %s: prefill on %s failed: %s", state.request_id, state.worker, reason)
        state.failures.append(f"{state.worker}: {reason}")
        state.transfer_failed = transfer
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
        if self.peers.gone(state.worker):
            self._next_attempt(state)
            return
        state.abort_rpc = self._ask_abort(state.worker, state.request_id)

    def _ask_abort(self, worker: str, request_id: str) -> grpc.Future:
        return self._stub(worker).Abort.future(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)

    def _after_abort(self, state: RemotePrefillState) -> None:
        rpc, state.abort_rpc = state.abort_rpc, None
        if not abort_answered(rpc, state.request_id, state.worker, self.peers):
            state.retry_at = time.monotonic() + ABORT_RETRY_S  # neither confirmed nor dead: ask again
            return
        self._next_attempt(state)

    def _next_attempt(self, state: RemotePrefillState) -> None:
        rid = state.request_id
        if state.cancelled:  # nothing is in flight now: its blocks can go
            self.states.pop(rid, None)
            self._events.append(Released(rid))
            return
        while state.has_next_worker and time.monotonic() < state.deadline and state.reserved is not None:
            state.attempt += 1
            if self.peers.gone(state.worker):
                state.failures.append(f"{state.worker}: left the deployment")
                state.transfer_failed = False
                continue
            self._send_prefill(state, state.reserved)
            return
        del self.states[rid]
        cause = (pb.LOCAL_PREFILL_DEADLINE if time.monotonic() >= state.deadline
                 else pb.LOCAL_PREFILL_TRANSFER_FAILED if state.transfer_failed else pb.LOCAL_PREFILL_PREFILL_FAILED)
        log.info("request %s: no prefill worker left (%s); prefilling locally", rid, "; ".join(state.failures))
        self._events.append(PrefillHere(rid, list(state.failures), cause))

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        """Every call to a prefill worker goes through here (its Prefill and its Aborts)."""
        return self.peers.stub(address)
