"""gRPC face of the decode worker: Generate streams and SetPeers, plus TransferInfo / Health / Stats."""

from __future__ import annotations

import logging
import queue
import uuid

import grpc

from common import trace
from common.grammar_spec import GrammarError
from decode.worker import DecodeWorker
from engine.scheduler import QueueFull, RequestRejected
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import params_from_pb
from worker.loop import ShuttingDown

log = logging.getLogger(__name__)

_POLL_S = 0.5
PROVE_TIMEOUT_S = 10.0  # a peer's answer to Prove, a gRPC thread's work: a network bound, not an engine one


class DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        calls = self.worker.calls
        calls.opened()  # until the call ends, however it ends: a drain waits for it
        if not context.add_callback(calls.closed):
            calls.closed()
        rid = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        trace.event(rid, "arrived", prompt_tokens=len(request.prompt_token_ids), tenant=request.tenant)
        try:
            params = params_from_pb(request.params)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {e}")
        try:
            # here, not on the loop: others' steps go on; tenants take turns (not cache salts: a
            # client chooses its salt, and would count as many sources)
            self.worker.engine.compile_grammar(params, request.tenant, context.time_remaining())
        except GrammarError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: grammar: {e}")
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {rid}: {e}")
        out: queue.SimpleQueue = queue.SimpleQueue()
        prompt = list(request.prompt_token_ids)
        # A hand-off's KV source heads the list: its copy of the KV is asked for first.
        source = request.kv_source if request.kv_source.address and request.output_token_ids else None
        offered = ([source.address] if source is not None else []) + list(request.prefill_workers)
        prefill = self.worker.proven_prefill_workers(offered, PROVE_TIMEOUT_S)
        if source is not None and source.address not in prefill:
            source = None  # it could not prove itself (or is gone): the prefill workers, or here
        try:
            self.worker.call(lambda: self.worker.add(rid, prompt, params, request.priority,
                                                     prefill, out, context.time_remaining(),
                                                     request.cache_salt, list(request.output_token_ids), source),
                             timeout=self.worker.loop_wait_s())
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RequestRejected as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ShuttingDown as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: engine loop did not admit it in time")

        def cancel() -> None:
            self.worker.submit(lambda: self.worker.cancel(rid))

        if not context.add_callback(cancel):  # the call ended while the request was being admitted
            cancel()
        while True:
            try:
                msg = out.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            yield msg
            if msg.finish_reason != pb.FINISH_NONE:
                return

    def SetPeers(self, request: pb.SetPeersRequest, context: grpc.ServicerContext) -> pb.SetPeersResponse:
        """Answered at once, whatever the loop is doing (decode/worker.py `set_members`)."""
        self.worker.set_members(list(request.workers))
        return pb.SetPeersResponse()
