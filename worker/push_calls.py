"""What a KV writer's gRPC face shares, whichever worker writes (a prefill worker's computed
prompt, a drained decode worker's kept KV): a Prefill call waits for its push to end, an
Abort is answered once nothing of the request is in flight, and an Abort that overtook its
Prefill is remembered so the late Prefill is refused (`EarlyAborts`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from rpc import pdserve_pb2 as pb

_POLL_S = 0.5
# Request ids aborted before their Prefill arrived, remembered so that the late Prefill is
# refused rather than pushed into blocks the decode worker has reused: the most recent
# ones, as many as a deployment could have racing at once.
EARLY_ABORTS_KEPT = 4096


class EarlyAborts:
    """The ids of the most recent aborts that came before their request (loop thread only)."""

    def __init__(self, kept: int = EARLY_ABORTS_KEPT):
        self.kept = kept
        self._ids: OrderedDict[str, None] = OrderedDict()

    def not_here(self, request_id: str, confirmed: Future | None) -> None:
        """An abort of a request not here (yet): remembered, so that it is refused when it
        comes, and answered at once (`confirmed`: False, nothing was known)."""
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.kept:
            self._ids.popitem(last=False)
        if confirmed is not None:
            confirmed.set_result(False)

    def take(self, request_id: str) -> bool:
        """True (once) if `request_id` was aborted before it came."""
        return self._ids.pop(request_id, False) is None


def wait_for_reply(reply: Future, context: grpc.ServicerContext, request_id: str) -> pb.PrefillResponse:
    """The push's reply, or CANCELLED once the caller is gone (the call's callback aborts it)."""
    while True:
        try:
            return reply.result(timeout=_POLL_S)
        except FutureTimeout:
            if not context.is_active():
                return pb.PrefillResponse(error=pb.Error(code=pb.CANCELLED, message="caller gone",
                                                         request_id=request_id))


def confirm_abort(worker, abort: Callable[[str, Future], None], request_id: str,
                  context: grpc.ServicerContext) -> pb.AbortResponse:
    """Run `abort(request_id, confirmed)` on the worker's loop and answer once it confirms
    (nothing in flight); DEADLINE_EXCEEDED past the loop's own bound."""
    confirmed: Future = Future()
    worker.submit(lambda: abort(request_id, confirmed))
    try:
        return pb.AbortResponse(found=confirmed.result(timeout=worker.loop_wait_s()))
    except FutureTimeout:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"request {request_id}: writes still in flight after {worker.loop_wait_s():.0f}s")
