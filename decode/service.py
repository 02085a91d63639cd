"""gRPC face of the decode worker: Streams (a gateway's requests, all on one call),
Generate (one request on its own call) and SetPeers.

Both ways in share one admission (`prepare`: parameters, the grammar compile, proving the
prefill workers; then `add`, on the engine loop) and one way out (decode/step_batches.py:
each step's tokens leave as one message per call). A Streams call costs two threads
however many requests it carries: its reader (opens and cancels) and its sender (the
steps' messages); preparing, which may wait for a compile or a peer's proof, runs on a
small shared pool, which hands the add to the loop without waiting for it, so no request
has a thread of its own. A Generate's own thread waits for its add, and answers
UNAVAILABLE if the loop does not get to it in time.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from common import trace
from common.grammar_spec import GrammarError
from common.sampling_params import SamplingParams
from decode import metrics
from decode.step_batches import Outlet, StepBatches, responses
from decode.worker import DecodeWorker
from engine.scheduler import QueueFull, RequestRejected
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import params_from_pb
from worker.loop import ShuttingDown
from worker.prefix_fetch import Fetched

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a call's sender looks whether its call is still active
PROVE_TIMEOUT_S = 10.0  # a peer's answer to Prove, a gRPC thread's work: a network bound, not an engine one
ADMISSION_THREADS = 8  # opens prepared at once (each may wait for a compile or a proof, never for the loop)


class Refused(Exception):
    """An open the worker will not serve: the gRPC status code and why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class _Admission:
    """A request ready for the loop: what `prepare` found out about it."""

    request_id: str
    request: pb.GenerateRequest
    params: SamplingParams
    prefill: list[str]  # the offered prefill workers that proved themselves (a hand-off's KV source first)
    source: pb.KVSource | None
    timeout_s: float | None
    fetched: Fetched | None = None  # the prompt blocks fetched from a sibling before the loop saw it


class DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self._admissions = ThreadPoolExecutor(ADMISSION_THREADS, thread_name_prefix="admit")

    def prepare(self, request: pb.GenerateRequest, timeout_s: float | None) -> _Admission:
        """What must happen before the loop sees a request (any thread but the loop's; may wait
        for its grammar's compile or a prefill worker's proof): its admission, or Refused."""
        rid = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        trace.event(rid, "arrived", prompt_tokens=len(request.prompt_token_ids), tenant=request.tenant)
        try:
            params = params_from_pb(request.params)
        except ValueError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {e}") from None
        try:
            # here, not on the loop: others' steps go on; tenants take turns (not cache salts: a
            # client chooses its salt, and would count as many sources)
            self.worker.engine.compile_grammar(params, request.tenant, timeout_s)
        except GrammarError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: grammar: {e}") from None
        except QueueFull as e:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {rid}: {e}") from None
        # A hand-off's KV source heads the list: its copy of the KV is asked for first.
        source = request.kv_source if request.kv_source.address and request.output_token_ids else None
        offered = ([source.address] if source is not None else []) + list(request.prefill_workers)
        prefill = self.worker.proven_prefill_workers(offered, PROVE_TIMEOUT_S)
        if source is not None and source.address not in prefill:
            source = None  # it could not prove itself (or is gone): the prefill workers, or here
        fetched = self._fetch_prefix(rid, request) if request.prefix_source.address and source is None else None
        return _Admission(rid, request, params, prefill, source, timeout_s, fetched)

    def _fetch_prefix(self, rid: str, request: pb.GenerateRequest) -> Fetched | None:
        """Bring the prompt's leading blocks a sibling holds into this pool before the loop
        sees the request, so its schedule finds them cached (worker/prefix_fetch.py). Any
        failure leaves the request to compute them: this never refuses it."""
        src = request.prefix_source
        if src.address not in self.worker.proven_prefill_workers([src.address], PROVE_TIMEOUT_S):
            return None  # not a proven worker of this deployment: nothing is asked of it
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        try:
            done = self.worker.call(lambda: self.worker.fetch_prefix(rid, tokens, request.cache_salt, src),
                                    timeout=self.worker.loop_wait_s())
        except (TimeoutError, ShuttingDown):
            return None
        if done is None:
            return None
        bound = self.worker.remote_prefill_budget_s(src.blocks * self.worker.engine.block_size) + 5.0
        try:  # the fetch's own deadline resolves it first
            return done.result(timeout=bound)
        except Exception:  # the request computes the prefix
            log.exception("request %s: prefix fetch failed", rid)
            return None

    def add(self, adm: _Admission, out: Outlet) -> None:
        """The request joins the engine (on the loop thread), or Refused."""
        r = adm.request
        try:
            self.worker.add(adm.request_id, list(r.prompt_token_ids), adm.params, r.priority, adm.prefill, out,
                            adm.timeout_s, r.cache_salt, list(r.output_token_ids), adm.source, adm.fetched)
        except QueueFull as e:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except RequestRejected as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except ShuttingDown as e:
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def admit(self, request: pb.GenerateRequest, timeout_s: float | None, out: Outlet) -> str:
        """Prepare and add one request, waiting for the loop to take it (a Generate's thread):
        its id, or Refused (UNAVAILABLE when the loop does not get to it in time)."""
        adm = self.prepare(request, timeout_s)
        try:
            self.worker.call(lambda: self.add(adm, out), timeout=self.worker.loop_wait_s())
        except TimeoutError:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"request {adm.request_id}: engine loop did not admit it in time") from None
        return adm.request_id

    def cancel(self, request_id: str) -> None:
        self.worker.submit(lambda: self.worker.cancel(request_id))

    # -- one request on its own call ------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        calls = self.worker.calls
        calls.opened()  # until the call ends, however it ends: a drain waits for it
        if not context.add_callback(calls.closed):
            calls.closed()
        batches = StepBatches()
        try:
            rid = self.admit(request, context.time_remaining(), batches.outlet(0))
        except Refused as e:
            context.abort(e.code, e.message)
        if not context.add_callback(lambda: self.cancel(rid)):  # it ended while being admitted
            self.cancel(rid)
        while True:
            down = batches.take(_POLL_S)
            if down is None:
                if not context.is_active():
                    return
                continue
            for msg in responses(down):
                yield msg
                if msg.finish_reason != pb.FINISH_NONE:
                    return

    # -- a gateway's requests, all on one call ---------------------------------------------

    def Streams(self, request_iterator, context: grpc.ServicerContext):
        call = _StreamsCall(self, context)
        threading.Thread(target=call.read, args=(request_iterator,), name="streams-reader", daemon=True).start()
        try:
            while True:
                down = call.batches.take(_POLL_S)
                if down is not None:
                    metrics.STREAMS_DOWN_BYTES.observe(down.ByteSize())
                    yield down
                elif call.batches.closed or not context.is_active():
                    return  # the gateway ends the call (a half-close alone does not: streams may be running)
        finally:
            call.end()

    def SetPeers(self, request: pb.SetPeersRequest, context: grpc.ServicerContext) -> pb.SetPeersResponse:
        """Answered at once, whatever the loop is doing (decode/worker.py `set_members`)."""
        self.worker.set_members(list(request.workers))
        return pb.SetPeersResponse()


class _StreamsCall:
    """One gateway's Streams call: its streams by number, and the request id each has here.
    Every stream counts as an open call (a drain waits for it) from its open to its last
    message; when the call ends, however it ends, its streams still running are cancelled."""

    def __init__(self, service: DecodeService, context: grpc.ServicerContext):
        self.service, self.context = service, context
        self.batches = StepBatches()
        self._lock = threading.Lock()
        self._ids: dict[int, str | None] = {}  # stream -> its request id here (None while it is admitted)
        self._cancelled: set[int] = set()  # cancelled while being admitted
        self._ended = False

    def read(self, request_iterator) -> None:
        try:
            for up in request_iterator:
                for op in up.opens:
                    self._open(op)
                for stream in up.cancels:
                    self._cancel(stream)
        except grpc.RpcError:
            pass  # the call broke: its sender sees it inactive, and end() cancels what is left
        except Exception:
            log.exception("Streams: reading the gateway's messages failed")
            self.end()

    def _open(self, op: pb.StreamOpen) -> None:
        calls = self.service.worker.calls
        with self._lock:
            if self._ended or op.stream in self._ids:
                refused = "the call is ending" if self._ended else f"stream {op.stream} is already open"
            else:
                refused = None
                self._ids[op.stream] = None
                calls.opened()
        if refused is not None:
            self.batches.refuse(op.stream, grpc.StatusCode.INVALID_ARGUMENT.value[0], refused)
            return
        self.service._admissions.submit(self._admit, op)

    def _admit(self, op: pb.StreamOpen) -> None:
        """On the admission pool: prepare, then hand the add to the loop without waiting for it
        (so a burst of opens is admitted a whole step's worth at a time, not a pool's)."""
        try:
            adm = self.service.prepare(op.request, op.timeout_s or None)
        except Refused as e:
            self._forget(op.stream)
            self.batches.refuse(op.stream, e.code.value[0], e.message)
            return
        except Exception as e:  # a bug must still answer the open
            log.exception("stream %d: admission failed", op.stream)
            self._forget(op.stream)
            self.batches.refuse(op.stream, grpc.StatusCode.INTERNAL.value[0], f"admission failed: {e}")
            return
        with self._lock:
            self._ids[op.stream] = adm.request_id
            cancel = self._ended or op.stream in self._cancelled
        out = self.batches.outlet(op.stream, lambda: self._last(op.stream))
        self.service.worker.submit(lambda: self._add(adm, out))
        if cancel:  # after the add: the loop runs them in order
            self.service.cancel(adm.request_id)

    def _add(self, adm: _Admission, out: Outlet) -> None:
        """On the loop: the request joins the engine, or its refusal goes out."""
        try:
            self.service.add(adm, out)
        except Refused as e:
            self._forget(out.stream)
            self.batches.refuse(out.stream, e.code.value[0], e.message)

    def _cancel(self, stream: int) -> None:
        with self._lock:
            rid = self._ids.get(stream)
            if rid is None:
                if stream in self._ids:
                    self._cancelled.add(stream)  # being admitted: cancelled once it is
                return
        self.service.cancel(rid)

    def _last(self, stream: int) -> None:
        """Its last message was gathered (loop thread): the stream is over here."""
        self._forget(stream)

    def _forget(self, stream: int) -> None:
        with self._lock:
            if stream not in self._ids:
                return
            del self._ids[stream]
            self._cancelled.discard(stream)
        self.service.worker.calls.closed()

    def end(self) -> None:
        """The call is over: what still runs on it has no reader, and is cancelled."""
        with self._lock:
            self._ended = True
            running = [rid for rid in self._ids.values() if rid is not None]
        for rid in running:
            self.service.cancel(rid)
        self.batches.close()
