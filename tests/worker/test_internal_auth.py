"""The internal gRPC's shared secret: a worker started with PDSERVE_INTERNAL_TOKEN refuses
calls without it (UNAUTHENTICATED, unary and streaming alike) and serves those with it."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import Stubs, start_workers
from rpc import auth, proof
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc

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
        stub = Stubs(channel, "decode")
        with pytest.raises(grpc.RpcError) as e:
            stub.Health(pb.HealthRequest(deep=True), timeout=10, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub) if metadata is None else list(stub.Generate(pb.GenerateRequest(), metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_calls_with_the_secret_are_served(worker, monkeypatch):
    monkeypatch.setenv(auth.ENV, SECRET)
    with auth.channel(worker.address) as channel:
        stub = Stubs(channel, "decode")
        assert stub.Health(pb.HealthRequest(deep=True), timeout=10).ok
        assert len(_generate(stub)) == 3


def test_the_gateways_async_channel_sends_the_secret_on_streams_too(worker, monkeypatch):
    """grpc.aio files an interceptor under one call kind only: streaming calls need their own."""
    import asyncio

    monkeypatch.setenv(auth.ENV, SECRET)

    async def run() -> tuple[bool, list[int]]:
        async with auth.aio_channel(worker.address) as channel:
            stub = Stubs(channel, "decode")
            ok = (await stub.Health(pb.HealthRequest(deep=True), timeout=10)).ok
            req = pb.GenerateRequest(request_id="auth-aio", prompt_token_ids=[5, 6, 7],
                                     params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            return ok, [t async for msg in stub.Generate(req, timeout=30) for t in msg.token_ids]

    ok, tokens = asyncio.run(run())
    assert ok and len(tokens) == 3


def test_the_gateways_streams_call_sends_the_secret_too(worker, monkeypatch):
    """The gateway's one Streams call per decode worker (bidirectional: its own interceptor kind)."""
    import asyncio

    from gateway.worker_streams import WorkerStreams

    monkeypatch.setenv(auth.ENV, SECRET)

    async def run() -> list[int]:
        async with auth.aio_channel(worker.address) as channel:
            streams = WorkerStreams(channel, worker.address)
            req = pb.GenerateRequest(request_id="auth-bidi", prompt_token_ids=[5, 6, 7],
                                     params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            call = streams.open(req, 30)
            tokens = []
            while True:
                msg = await call.read()
                tokens += msg.token_ids
                if msg.finish_reason != pb.FINISH_NONE:
                    await streams.close()
                    return tokens

    assert len(asyncio.run(run())) == 3


class _Impostor:
    """A gRPC server on loopback that serves every method and records the metadata it is
    sent: an address someone handed to a client as a worker's. With `relay_to`, it answers
    Prove by asking a real worker (a relay of the challenge)."""

    def __init__(self, relay_to: str | None = None):
        from concurrent import futures

        self.seen: list[tuple[str, dict]] = []
        self._relay = relay_to
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details):  # grpc.GenericRpcHandler
        self.seen.append((details.method, dict(details.invocation_metadata)))

        def unary(request: bytes, context) -> bytes:
            if details.method == proof.METHOD and self._relay:
                with grpc.insecure_channel(self._relay) as real:
                    return real.unary_unary(proof.METHOD)(request, timeout=10)
            return b""

        return grpc.unary_unary_rpc_method_handler(unary)

    def got_the_token(self) -> bool:
        return any(auth.HEADER in md for _, md in self.seen)


@pytest.mark.parametrize("relay", [False, True])
def test_the_token_goes_only_to_a_peer_that_proves_it_holds_it(worker, monkeypatch, relay):
    """An address that is not one of the deployment's workers (a bare server, or one that
    relays the challenge to a real worker) never receives the token: the call fails
    UNAUTHENTICATED before anything is sent, on sync and async channels alike."""
    import asyncio

    monkeypatch.setenv(auth.ENV, SECRET)
    impostor = _Impostor(relay_to=worker.address if relay else None)
    try:
        with auth.channel(impostor.address) as channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(deep=False), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "did not prove" in e.value.details()

        async def aio_call() -> grpc.StatusCode:
            async with auth.aio_channel(impostor.address) as channel:
                try:
                    req = pb.GenerateRequest(request_id="x", prompt_token_ids=[5], params=pb.SamplingParams(max_tokens=1))
                    [m async for m in pb_grpc.DecodeWorkerStub(channel).Generate(req, timeout=10)]
                except grpc.RpcError as err:
                    return err.code()
            return grpc.StatusCode.OK

        assert asyncio.run(aio_call()) == grpc.StatusCode.UNAUTHENTICATED
        assert impostor.seen and all(m == proof.METHOD for m, _ in impostor.seen), impostor.seen
        assert not impostor.got_the_token()
    finally:
        impostor.server.stop(0)


def test_a_peer_that_proves_itself_gets_the_token_once_per_channel(worker, monkeypatch):
    monkeypatch.setenv(auth.ENV, SECRET)
    with auth.channel(worker.address) as channel:
        stub = Stubs(channel, "decode")
        assert all(stub.Health(pb.HealthRequest(deep=False), timeout=10).ok for _ in range(3))
    with grpc.insecure_channel(worker.address) as raw, pytest.raises(grpc.RpcError) as e:
        raw.unary_unary(proof.METHOD)(b"short", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_decode_worker_sends_no_token_to_an_offered_prefill_worker_that_cannot_prove_itself(tmp_path, monkeypatch):
    """The gateway names the prefill workers in each Generate; a decode worker (with its KV
    transport) offered an address that is not one of the deployment's workers leaves it out,
    prefills locally, and the address never sees the token."""
    model = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa", seed=3)
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "64", "--prefill-timeout", "60"],
                                {auth.ENV: SECRET})], model, tmp_path)
    impostor = _Impostor()
    try:
        monkeypatch.setenv(auth.ENV, SECRET)
        with auth.channel(decode.address) as channel:
            req = pb.GenerateRequest(request_id="offered-1", prompt_token_ids=list(range(5, 45)),
                                     prefill_workers=[impostor.address],
                                     params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            tokens = [t for msg in pb_grpc.DecodeWorkerStub(channel).Generate(req, timeout=60) for t in msg.token_ids]
        assert len(tokens) == 3
        assert not impostor.got_the_token(), impostor.seen
        assert "left out" in decode.log_path.read_text()
    finally:
        impostor.server.stop(0)
        decode.stop()


def _silent_peer() -> socket.socket:
    """A listener that accepts TCP (the kernel completes the handshake) and never answers:
    a host that froze with its port open."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    return silent


def test_a_silent_peer_holds_no_async_caller_past_its_own_timeout(monkeypatch):
    """A stream with a long bound proves the peer first; a health check on the same channel
    with a 1 s deadline fails by its own deadline, not the stream's (a /ready that hung on
    a worker that accepts TCP but never answers)."""
    import asyncio

    monkeypatch.setenv(auth.ENV, SECRET)
    with _silent_peer() as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"

        async def run() -> grpc.StatusCode:
            async with auth.aio_channel(address) as channel:
                req = pb.GenerateRequest(request_id="long", prompt_token_ids=[5], params=pb.SamplingParams(max_tokens=1))

                async def stream() -> None:
                    [m async for m in pb_grpc.DecodeWorkerStub(channel).Generate(req, timeout=300)]
                long = asyncio.create_task(stream())
                await asyncio.sleep(0.2)  # it is proving the peer
                try:
                    await asyncio.wait_for(pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(deep=True), timeout=1), 20)
                except grpc.RpcError as e:
                    return e.code()
                finally:
                    long.cancel()
                return grpc.StatusCode.OK

        assert asyncio.run(run()) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_silent_peer_holds_no_caller_past_its_own_timeout(monkeypatch):
    """The same on a sync channel (a decode worker's to its prefill peers)."""
    import threading
    from concurrent.futures import Future

    monkeypatch.setenv(auth.ENV, SECRET)
    with _silent_peer() as silent, auth.channel(f"127.0.0.1:{silent.getsockname()[1]}") as channel:
        stub = pb_grpc.WorkerStub(channel)

        def call(timeout: float, into: Future) -> None:
            try:
                into.set_result(stub.Health(pb.HealthRequest(deep=True), timeout=timeout))
            except Exception as e:
                into.set_exception(e)
        # the long call's proof ends at its network bound (30 s) on a thread nobody waits for
        threading.Thread(target=call, args=(300, Future()), daemon=True).start()
        time.sleep(0.2)  # it is proving the peer
        short: Future = Future()
        threading.Thread(target=call, args=(1, short), daemon=True).start()
        with pytest.raises(grpc.RpcError) as e:
            short.result(timeout=20)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
