"""gRPC face of the prefill worker: Prefill, Abort, SetPeers, plus TransferInfo / Health / Stats."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import grpc

from engine.scheduler import QueueFull
from prefill.worker import PrefillWorker
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import params_from_pb
from worker.loop import ShuttingDown
from worker.push_calls import confirm_abort, wait_for_reply

log = logging.getLogger(__name__)

PROVE_TIMEOUT_S = 10.0  # the holder's answer to Prove: a network bound, not an engine one
FETCH_BOUND_S = 60.0  # a prefix fetch from the asking decode worker, at most (else: computed)


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        self.worker.calls.opened()  # until it returns: a drain waits for it
        try:
            return self._prefill(request, context)
        finally:
            self.worker.calls.closed()

    def _prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        rid = request.request_id
        reply: Future = Future()
        try:
            params = params_from_pb(request.params)
            self.worker.engine.compile_grammar(params)  # here, not on the loop: others' steps go on
            if request.kv_holder and request.destination.num_cached_tokens >= self.worker.block_size:
                self._fetch_prefix(request, context)
            self.worker.call(lambda: self.worker.add(request, params, reply, context.time_remaining()),
                             timeout=self.worker.loop_wait_s())
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ShuttingDown as e:  # a reply: the caller knows nothing of it started
            return pb.PrefillResponse(error=pb.Error(code=pb.CANCELLED, message=str(e), request_id=rid))
        except ValueError as e:  # bad parameters, destination or handshake (HandshakeError, RequestRejected)
            log.info("request %s: refused: %s", rid, e)
            return pb.PrefillResponse(error=pb.Error(code=pb.INVALID_REQUEST, message=str(e), request_id=rid))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: engine loop did not admit it in time")
        # The caller gave up (deadline, cancel, crash): stop the work and free the blocks.
        def abort() -> None:
            if not reply.done():
                self.worker.submit(lambda: self.worker.abort(rid))

        if not context.add_callback(abort):  # the caller left while the request was being admitted
            abort()
        return wait_for_reply(reply, context, rid)

    def _fetch_prefix(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> None:
        """Bring the prompt blocks the asking decode worker holds and this pool lacks here
        before the loop sees the request, so its schedule finds them cached (a conversation's
        earlier turns decoded there; worker/prefix_fetch.py). Any failure leaves the request
        to compute them: this never refuses it."""
        rid = request.request_id
        holder = request.kv_holder
        if holder not in self.worker.fetches.peers.proven([holder], PROVE_TIMEOUT_S):
            return  # it did not prove it belongs to this deployment: nothing is asked of it
        left = context.time_remaining()
        bound = FETCH_BOUND_S if left is None else min(left, FETCH_BOUND_S)
        try:
            done = self.worker.call(lambda: self.worker.fetch_prefix(
                rid, list(request.prompt_token_ids), request.cache_salt, holder,
                request.destination.num_cached_tokens, bound), timeout=self.worker.loop_wait_s())
        except (TimeoutError, ShuttingDown):
            return
        if done is None:
            return
        try:  # the fetch's own deadline resolves it first
            done.result(timeout=bound + 5.0)
        except Exception:  # the request computes the prefix
            log.exception("request %s: prefix fetch from %s failed", rid, holder)

    def SetPeers(self, request: pb.SetPeersRequest, context: grpc.ServicerContext) -> pb.SetPeersResponse:
        """Answered at once, whatever the loop is doing: the check reads the new list next."""
        self.worker.set_members(list(request.decode_agents), list(request.workers))
        return pb.SetPeersResponse()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Answers once nothing of the request is in flight (its blocks are free to reuse)."""
        return confirm_abort(self.worker, self.worker.abort, request.request_id, context)
