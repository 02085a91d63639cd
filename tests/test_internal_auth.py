"""The internal gRPC's shared secret: a worker started with PDSERVE_INTERNAL_TOKEN refuses
calls without it (UNAUTHENTICATED, unary and streaming alike) and serves those with it."""

from __future__ import annotations

import grpc
import pytest

from engine.rpc import auth
from engine.rpc import pdserve_pb2 as pb
from engine.rpc import pdserve_pb2_grpc as pb_grpc
from tests.tiny_models import write_tiny_checkpoint
from tests.worker_procs import start_workers

SECRET = "internal-secret-for-the-test"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", seed=3)
    (w,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "64", "--no-transfer"],
                           {auth.ENV: SECRET})], model, tmp_path_factory.mktemp("logs"))
    yield w
    w.stop()
    assert SECRET not in w.log_path.read_text()  # never logged


def _generate(stub) -> list[int]:
    req = pb.GenerateRequest(request_id="auth-1", prompt_token_ids=[5, 6, 7],
                             params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    return [t for msg in stub.Generate(req, timeout=30) for t in msg.token_ids]


@pytest.mark.parametrize("metadata", [None, [(auth.HEADER, "wrong")], [(auth.HEADER, "")]])
def test_calls_without_the_secret_are_refused(worker, metadata):
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Health(pb.HealthRequest(deep=True), timeout=10, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub) if metadata is None else list(stub.Generate(pb.GenerateRequest(), metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_calls_with_the_secret_are_served(worker, monkeypatch):
    monkeypatch.setenv(auth.ENV, SECRET)
    with auth.channel(worker.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        assert stub.Health(pb.HealthRequest(deep=True), timeout=10).ok
        assert len(_generate(stub)) == 3


def test_the_gateways_async_channel_sends_the_secret_on_streams_too(worker, monkeypatch):
    """grpc.aio files an interceptor under one call kind only: streaming calls need their own."""
    import asyncio

    monkeypatch.setenv(auth.ENV, SECRET)

    async def run() -> tuple[bool, list[int]]:
        async with auth.aio_channel(worker.address) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            ok = (await stub.Health(pb.HealthRequest(deep=True), timeout=10)).ok
            req = pb.GenerateRequest(request_id="auth-aio", prompt_token_ids=[5, 6, 7],
                                     params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            return ok, [t async for msg in stub.Generate(req, timeout=30) for t in msg.token_ids]

    ok, tokens = asyncio.run(run())
    assert ok and len(tokens) == 3
