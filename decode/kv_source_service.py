"""gRPC face of a decode worker as a KV source: the PrefillWorker service's Prefill and
Abort, for the decode workers that take over its handed-off requests (decode/kv_source.py)
and those that fetch a prompt's prefix from its prefix cache (worker/prefix_fetch.py).
A taker asks it exactly as it asks a prefill worker (decode/remote_prefill.py), so its
attempts, aborts and fallbacks (the next worker, or a local prefill) apply unchanged."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import grpc

from decode.kv_source import NotHeld
from decode.worker import DecodeWorker
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.push_calls import confirm_abort, wait_for_reply

log = logging.getLogger(__name__)


class KVSourceService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        """Push the kept KV of `request.kv_request_id`, or with `prefix_only` the prompt's
        leading blocks its prefix cache holds; anything else is refused (a decode worker
        computes no prefill for others)."""
        rid = request.request_id
        if not request.kv_request_id and not request.prefix_only:
            return pb.PrefillResponse(error=pb.Error(code=pb.INVALID_REQUEST, request_id=rid,
                                                     message=f"request {rid}: a decode worker prefills for no one"))
        self.worker.calls.opened()  # until it returns: a drain waits for it
        try:
            reply: Future = Future()
            try:
                self.worker.call(lambda: self.worker.pull(request, reply, context.time_remaining()),
                                 timeout=self.worker.loop_wait_s())
            except ValueError as e:  # not kept here, tokens or destination do not match (HandshakeError too)
                log.info("request %s: pull refused: %s", rid, e)
                code = pb.KV_NOT_HELD if isinstance(e, NotHeld) else pb.INVALID_REQUEST
                return pb.PrefillResponse(error=pb.Error(code=code, message=str(e), request_id=rid))
            except TimeoutError:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: engine loop did not take the pull in time")

            def abort() -> None:  # the taker gave up (deadline, cancel, crash)
                if not reply.done():
                    self.worker.submit(lambda: self.worker.abort_pull(rid))

            if not context.add_callback(abort):
                abort()
            return wait_for_reply(reply, context, rid)
        finally:
            self.worker.calls.closed()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Answers once nothing of the pull is in flight (the taker's blocks are free to reuse)."""
        return confirm_abort(self.worker, self.worker.abort_pull, request.request_id, context)
