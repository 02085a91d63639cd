"""The decode worker: owns each request from Generate to release (DESIGN.md steps 5, 8-11).

Runs on its EngineLoop thread. A request with prefill workers and a long enough uncached
prompt reserves its blocks and asks the first prefill worker to fill them (moving down
the list if that one fails before the KV is complete, then prefilling locally); otherwise
it is prefilled here as chunked prefill in the decode batch (conditional disaggregation,
and the aggregated mode when no prefill workers are given). Every step's new tokens go to
the request's stream at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from decode.remote_prefill import Phase, RemotePrefillState, new_transfer_id, request_of, worker_is_gone
from engine.llm_engine import LLMEngine, StepResult
from engine.sampling_params import SamplingParams
from engine.scheduler import RemotePrefill, RequestRejected, SchedulerOutput
from engine.sequence import FinishReason
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import finish_to_pb, logprobs_from_pb, logprobs_to_pb, params_to_pb
from transfer import KVReceiver, ReceiveStatus, TransferAgent
from worker.liveness import DEFAULT_STALL_FLOOR_S
from worker.loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where one request's responses go, and what its final message reports."""

    out: queue.SimpleQueue
    prompt_len: int
    params: SamplingParams
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_tokens: int = 0
    cached_tokens: int = 0
    prefill_timings: pb.Timings | None = None


REMOTE_PREFILL_SLACK = 10.0  # a remote prefill may take this many times its measured compute


class DecodeWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, name: str, agent: TransferAgent | None = None,
                 local_prefill_threshold: int = 0, prefill_timeout_s: float = 60.0,
                 stall_floor_s: float = DEFAULT_STALL_FLOOR_S):
        super().__init__(engine, name=f"{name}-loop", stall_floor_s=stall_floor_s)
        self.name = name
        self.agent = agent
        self.receiver = KVReceiver(agent) if agent is not None else None
        self.local_prefill_threshold = local_prefill_threshold
        self.prefill_timeout_s = prefill_timeout_s
        self.streams: dict[str, _Stream] = {}
        self.remote: dict[str, RemotePrefillState] = {}
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self._channels_lock = threading.Lock()  # the loop and RPC threads (proving) both open them
        self._transfer_info = agent.info().to_bytes() if agent is not None else b""
        self.kv_blocks_transferred = 0
        self._progress_failed = False
        if self.receiver is not None:
            # NIXL progress between layers while remote KV is awaited: a prefill worker's
            # push (and so its Prefill reply) completes only when this side progresses.
            self.between_layers = self._progress_transfers

    # -- commands (run on the loop thread) -----------------------------------------------

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
            prefill_workers: list[str], out: queue.SimpleQueue, timeout_s: float | None,
            cache_salt: str = "") -> None:
        """Admit a request (raises RequestRejected / QueueFull for the RPC to answer)."""
        if request_id in self.remote or self.engine.holds_blocks(request_id):
            # Held blocks (waiting for a prefill worker's abort confirmation) are keyed by this id too.
            raise RequestRejected(request_id, "duplicate request id (one with this id is still in flight)")
        uncached = len(prompt) - self.engine.num_cached_tokens(prompt, cache_salt)
        remote = bool(prefill_workers) and self.agent is not None and uncached > self.local_prefill_threshold
        self.engine.add_request(request_id, prompt, params, priority, remote_prefill=remote, cache_salt=cache_salt)
        self.streams[request_id] = _Stream(out, len(prompt), params)
        if remote:
            budget = self.remote_prefill_budget_s(uncached)
            deadline = time.monotonic() + min(timeout_s or budget, budget)
            self.remote[request_id] = RemotePrefillState(request_id, list(prefill_workers), [], 0, deadline)
        log.info("request %s: admitted, %d prompt tokens (%d uncached), %s prefill", request_id, len(prompt),
                 uncached, "remote" if remote else "local")

    def remote_prefill_budget_s(self, uncached_tokens: int) -> float:
        """How long a remote prefill of this many tokens may take, all attempts together,
        before it is aborted and prefilled here: `--prefill-timeout`, or REMOTE_PREFILL_SLACK
        times what this worker measured itself computing that prompt in, if longer (a slow
        host gets the time its speed needs; a prefill worker's queue and the transfer are
        in the slack)."""
        rate = self.liveness.prefill_tokens_per_s
        measured = REMOTE_PREFILL_SLACK * uncached_tokens / rate if rate > 0 else 0.0
        return max(self.prefill_timeout_s, measured)

    def cancel(self, request_id: str) -> None:
        """The client went away: stop the request within a step; blocks a prefill worker may
        still be writing are freed only once it confirms (or is known dead)."""
        if request_id not in self.streams:
            return  # already finished (gRPC calls back on every end of the call)
        state = self.remote.get(request_id)
        self.engine.abort_request(request_id)
        if state is not None:
            if not self.engine.holds_blocks(request_id):  # never got blocks: nothing can be written
                del self.remote[request_id]
            elif state.phase is Phase.PREFILLING:
                self.receiver.forget(state.transfer_id)
                self._abort_attempt(state, "cancelled")
            # ABORTING: the pending Abort confirmation releases the blocks (_next_attempt)
        self._close(request_id, pb.GenerateResponse(finish_reason=pb.ABORT))
        log.info("request %s: cancelled", request_id)

    # -- the loop's hooks ----------------------------------------------------------------

    def _progress_transfers(self) -> None:
        """During a step (between layers): a prefill worker's push completes only when this
        side's NIXL makes progress, and its Prefill reply waits for that."""
        if not self.remote:
            return
        try:
            self.receiver.progress()
        except Exception:  # a failing agent must not fail the forward pass; poll() meets it again
            if not self._progress_failed:
                log.exception("NIXL progress between layers failed")
            self._progress_failed = True

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """A Prefill goes out in the step that reserved its blocks, before that step's forward
        pass, not after it."""
        self._start_remotes(out.remote_prefills)

    def _start_remotes(self, reserved: list[RemotePrefill]) -> None:
        """Send the Prefill of each request whose blocks were just reserved. One that cannot be
        sent is prefilled locally (or aborted, if its Prefill may have gone out), so it never
        strands the others or waits with its blocks reserved."""
        for rp in reserved:
            try:
                self._start_remote(rp)
            except Exception as e:
                log.exception("request %s: starting its remote prefill failed", rp.seq.request_id)
                state = self.remote.get(rp.seq.request_id)
                if state is None or state.phase is not Phase.PREFILLING:
                    continue
                if state.rpc is None:  # nothing went out: nobody can be writing its blocks
                    del self.remote[state.request_id]
                    self.receiver.forget(state.transfer_id)
                    self.engine.remote_kv_failed(state.request_id)
                else:
                    self._attempt_failed(state, f"{type(e).__name__}: {e}")

    def poll(self) -> bool:
        busy = False
        if self.receiver is not None:
            for ev in self.receiver.poll():
                busy = True
                state = self.remote.get(request_of(ev.request_id))
                if state is None or state.phase is not Phase.PREFILLING or ev.request_id != state.transfer_id:
                    continue  # an earlier attempt's (expect() only matches the current one: belt and braces)
                if ev.status is ReceiveStatus.COMPLETE:
                    state.kv_complete = True
                else:
                    self._attempt_failed(state, f"KV {ev.status.value}")
        for state in list(self.remote.values()):
            busy |= self._poll_remote(state)
        return busy

    def on_step(self, result: StepResult) -> None:
        for d in result.outputs:
            self._deliver(d.request_id, d.token_ids, d.finish_reason, d.logprobs, d.num_cached_tokens)

    # -- remote prefill -------------------------------------------------------------------

    def _start_remote(self, rp: RemotePrefill) -> None:
        if self.engine.awaiting_kv(rp.seq.request_id) is None:
            return  # cancelled since the reservation: cancel() sent the Abort whose answer frees the blocks
        state = self.remote[rp.seq.request_id]
        state.destination_blocks = rp.destination_blocks
        state.num_cached_tokens = rp.num_cached_tokens
        self.streams[state.request_id].cached_tokens = rp.num_cached_tokens
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

    def _poll_remote(self, state: RemotePrefillState) -> bool:
        if state.phase is Phase.ABORTING:
            if state.abort_rpc is not None and state.abort_rpc.done():
                self._after_abort(state)
                return True
            return False
        if state.rpc is not None and state.rpc.done():
            rpc, state.rpc = state.rpc, None
            try:
                resp = rpc.result()
            except grpc.RpcError as e:
                self._attempt_failed(state, f"{e.code().name}: {e.details()}", gone=worker_is_gone(e))
                return True
            if resp.error.code != pb.ERROR_NONE:
                self._attempt_failed(state, resp.error.message, gone=True)  # it replied: nothing in flight
                return True
            state.first_token = resp.first_token_id
            state.first_logprobs = logprobs_from_pb(resp.first_logprobs) if resp.HasField("first_logprobs") else None
            self.streams[state.request_id].prefill_timings = resp.timings
        if state.kv_complete and state.first_token is not None:
            self._remote_done(state)
            return True
        return False

    def _remote_done(self, state: RemotePrefillState) -> None:
        state.phase = Phase.DONE
        del self.remote[state.request_id]
        self.kv_blocks_transferred += len(state.destination_blocks)
        update = self.engine.remote_kv_ready(state.request_id, state.first_token)
        if update is not None:
            lps = [state.first_logprobs] if state.first_logprobs is not None else None
            self._deliver(state.request_id, update.new_token_ids, update.finish_reason, lps, state.num_cached_tokens)

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
        seq = self.engine.awaiting_kv(rid)
        if seq is None:  # cancelled meanwhile
            self.remote.pop(rid, None)
            self.engine.release(rid)
            return
        if state.has_next_worker and time.monotonic() < state.deadline:
            state.attempt += 1
            self._send_prefill(state, seq.prompt_token_ids, seq.params, seq.priority, seq.cache_salt)
            return
        del self.remote[rid]
        log.info("request %s: no prefill worker left (%s); prefilling locally", rid, "; ".join(state.failures))
        self.engine.remote_kv_failed(rid)

    def _channel(self, address: str) -> tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]:
        with self._channels_lock:
            entry = self._channels.get(address)
            if entry is None:
                ch = auth.channel(address)
                entry = self._channels[address] = (ch, pb_grpc.PrefillWorkerStub(ch))
            return entry

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        return self._channel(address)[1]

    def proven_prefill_workers(self, addresses: list[str], timeout_s: float) -> list[str]:
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

    # -- streams --------------------------------------------------------------------------

    def _deliver(self, request_id: str, token_ids: list[int], reason: FinishReason | None, logprobs,
                 num_cached: int) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        now = time.monotonic()
        if stream.first_token_at is None and token_ids:
            stream.first_token_at = now
        stream.num_tokens += len(token_ids)
        msg = pb.GenerateResponse(token_ids=token_ids, finish_reason=finish_to_pb(reason))
        if logprobs:
            msg.logprobs.extend(logprobs_to_pb(lp) for lp in logprobs)
        if reason is not None:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=stream.prompt_len, completion_tokens=stream.num_tokens,
                                        cached_prompt_tokens=max(num_cached, stream.cached_tokens)))
            timings = pb.Timings(first_token_s=(stream.first_token_at or now) - stream.arrived)
            if stream.prefill_timings is not None:
                timings.queue_s = stream.prefill_timings.queue_s
                timings.prefill_s = stream.prefill_timings.prefill_s
                timings.transfer_s = stream.prefill_timings.transfer_s
            msg.timings.CopyFrom(timings)
            if reason is FinishReason.ERROR:
                msg.error.CopyFrom(pb.Error(code=pb.PREFILL_FAILED, message="prefill failed", request_id=request_id))
        stream.out.put(msg)
        if reason is not None:
            del self.streams[request_id]

    def _close(self, request_id: str, msg: pb.GenerateResponse) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.out.put(msg)
