"""The largest message an internal call carries both ways (rpc/auth.py MAX_MESSAGE_BYTES):
gRPC's own default takes 4 MiB, which a merged StreamsDown of a step with many requests'
top-logprobs or a large Stats could pass. The channels every gateway, controller and
worker opens, and the server every worker runs, are set past it on both sides."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from bench.harness.worker_procs import free_port
from rpc.auth import MAX_MESSAGE_BYTES, SERVER_OPTIONS, channel

BIG = 6 << 20  # past gRPC's default 4 MiB, well under ours


def _echo(request: bytes, context) -> bytes:
    return request + b"!" * (BIG - len(request))  # a big answer to a big question


@pytest.fixture()
def server():
    port = free_port()
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(_echo)}),))
    s.add_insecure_port(f"127.0.0.1:{port}")
    s.start()
    yield f"127.0.0.1:{port}"
    s.stop(0)


def test_both_sides_take_messages_past_grpcs_default(server):
    assert MAX_MESSAGE_BYTES > BIG
    with channel(server) as ch:
        answer = ch.unary_unary("/test.Echo/Call")(b"?" * (BIG - 1), timeout=30)
    assert len(answer) == BIG
    with grpc.insecure_channel(server) as plain:  # gRPC's defaults: the answer is refused
        with pytest.raises(grpc.RpcError) as refused:
            plain.unary_unary("/test.Echo/Call")(b"?", timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
