"""A decode worker's Streams call: many requests on one call, one message per engine step
(decode/step_batches.py, decode/service.py), against a real worker process over real gRPC.

What it proves: the tokens are those the per-request Generate gives; one message carries
several streams' tokens; a refused open, a cancel and the end of the whole call each reach
the right streams and give every block back; and hundreds of streams cost the worker no
thread each."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc
import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import start_workers, wait_idle
from rpc import pdserve_pb2 as pb


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", seed=5)
    args = ["--dtype", "float32", "--no-transfer", "--kv-blocks", "1024", "--max-num-seqs", "512",
            "--max-waiting", "512"]
    # Every step lasts at least 20 ms: a 400-token stream outlasts its cancel on any host.
    env = {"PDSERVE_FAULT_STEP_FLOOR_S": "0.02"}
    [worker] = start_workers([("decode", args, env)], model, tmp_path_factory.mktemp("logs"))
    yield worker
    worker.stop()


def _request(rid: str, max_tokens: int, temperature: float = 0.0, prompt=(1, 2, 3, 4, 5)) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), params=params)


class Call:
    """One Streams call, driven from this thread: `send` puts a StreamsUp on it, `read_all`
    gathers every stream's messages until the given streams have ended."""

    def __init__(self, worker):
        self._up: queue.Queue = queue.Queue()
        self.downs: list[pb.StreamsDown] = []
        self.responses = worker.stub.Streams(iter(self._up.get, None), timeout=120)
        self.by_stream: dict[int, list] = {}

    def send(self, opens=(), cancels=()) -> None:
        self._up.put(pb.StreamsUp(opens=list(opens), cancels=list(cancels)))

    def read_until_ended(self, streams: set[int]) -> None:
        ended = set()
        for down in self.responses:
            self.downs.append(down)
            start = 0
            for stream, count in zip(down.streams, down.counts):
                self.by_stream.setdefault(stream, []).append(list(down.token_ids[start:start + count]))
                start += count
            for ev in down.events:
                self.by_stream.setdefault(ev.stream, []).append(ev)
                if not ev.HasField("response") or ev.response.finish_reason != pb.FINISH_NONE:
                    ended.add(ev.stream)
            if streams <= ended:
                return

    def tokens(self, stream: int) -> list[int]:
        out = []
        for item in self.by_stream[stream]:
            out += item if isinstance(item, list) else list(item.response.token_ids)
        return out

    def last(self, stream: int) -> pb.StreamEvent:
        return self.by_stream[stream][-1]

    def close(self) -> None:
        self._up.put(None)
        self.responses.cancel()


def test_streams_give_the_tokens_generate_gives_with_several_streams_per_message(decode):
    expected = {}
    for i in range(4):
        msgs = list(decode.stub.Generate(_request(f"g{i}", 12, prompt=(1 + i, 2, 3)), timeout=60))
        expected[i] = [t for m in msgs for t in m.token_ids]
        assert msgs[-1].finish_reason == pb.LENGTH
    call = Call(decode)
    try:
        call.send(opens=[pb.StreamOpen(stream=i, request=_request(f"s{i}", 12, prompt=(1 + i, 2, 3)), timeout_s=60)
                         for i in range(4)])
        call.read_until_ended({0, 1, 2, 3})
    finally:
        call.close()
    for i in range(4):
        assert call.tokens(i) == expected[i], i
        last = call.last(i)
        assert last.response.finish_reason == pb.LENGTH and last.response.usage.completion_tokens == 12
    # they decode in the same steps: one message carries several streams' tokens
    assert max(len(set(d.streams)) for d in call.downs) >= 2, [list(d.streams) for d in call.downs]
    s = wait_idle(decode)
    assert s.free_blocks == s.total_blocks and s.running_requests == 0


def test_a_refused_open_is_its_streams_alone(decode):
    call = Call(decode)
    try:
        bad = _request("bad", 4, temperature=-1.0)
        call.send(opens=[pb.StreamOpen(stream=7, request=bad), pb.StreamOpen(stream=8, request=_request("ok", 4))])
        call.read_until_ended({7, 8})
    finally:
        call.close()
    refused = call.last(7)
    assert not refused.HasField("response")
    assert refused.refused_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in refused.refused_message
    assert call.last(8).response.finish_reason == pb.LENGTH and len(call.tokens(8)) == 4


def test_a_cancelled_stream_ends_with_abort_and_frees_its_blocks(decode):
    call = Call(decode)
    try:
        call.send(opens=[pb.StreamOpen(stream=1, request=_request("long", 400)),
                         pb.StreamOpen(stream=2, request=_request("short", 6))])
        for down in call.responses:  # until the long one has streamed something
            call.downs.append(down)
            if 1 in down.streams:
                break
        call.send(cancels=[1])
        call.read_until_ended({1, 2})
    finally:
        call.close()
    assert call.last(1).response.finish_reason == pb.ABORT
    assert call.last(2).response.finish_reason == pb.LENGTH
    s = wait_idle(decode)
    assert s.free_blocks == s.total_blocks and s.running_requests == 0 and s.waiting_requests == 0, s


def test_the_end_of_the_call_ends_every_stream_on_it(decode):
    call = Call(decode)
    call.send(opens=[pb.StreamOpen(stream=i, request=_request(f"gone{i}", 400)) for i in range(6)])
    for down in call.responses:
        if len(set(down.streams)) >= 2:
            break
    call.close()  # the gateway died, or its connection did
    s = wait_idle(decode, timeout_s=30)
    assert s.free_blocks == s.total_blocks and s.running_requests == 0 and s.waiting_requests == 0, s


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_hundreds_of_streams_cost_the_worker_no_thread_each(decode):
    idle = _threads(decode.proc.pid)
    n = 400
    call = Call(decode)
    peak = idle
    done = threading.Event()

    def watch():
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, _threads(decode.proc.pid))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        call.send(opens=[pb.StreamOpen(stream=i, request=_request(f"many{i}", 8, prompt=(1 + i % 50, 2)))
                         for i in range(n)])
        call.read_until_ended(set(range(n)))
    finally:
        done.set()
        watcher.join()
        call.close()
    assert all(call.last(i).response.finish_reason == pb.LENGTH and len(call.tokens(i)) == 8 for i in range(n))
    # the call's reader and sender, the admission pool: a bounded few, not one per stream
    assert peak - idle < 20, (idle, peak)
    s = wait_idle(decode)
    assert s.free_blocks == s.total_blocks and s.running_requests == 0


def test_the_gateways_stream_ends_at_its_deadline_and_the_worker_lets_it_go(decode):
    """gateway/worker_streams.py: a stream past its deadline reads DEADLINE_EXCEEDED (as a
    per-request call's deadline would) and the worker aborts it; its neighbour on the same
    call goes on."""
    import asyncio

    from gateway.worker_streams import WorkerStreams
    from rpc import auth

    async def run():
        async with auth.aio_channel(decode.address) as channel:
            streams = WorkerStreams(channel, decode.address)
            late = streams.open(_request("late", 400), 1.0)  # 400 steps of >= 20 ms: far past 1 s
            fine = streams.open(_request("fine", 4), 60.0)
            with pytest.raises(grpc.RpcError) as failure:
                while True:
                    await late.read()
            tokens = []
            while True:
                msg = await fine.read()
                tokens += msg.token_ids
                if msg.finish_reason != pb.FINISH_NONE:
                    break
            await streams.close()
            return failure.value.code(), tokens

    code, tokens = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and len(tokens) == 4
    s = wait_idle(decode)
    assert s.free_blocks == s.total_blocks and s.running_requests == 0, s
