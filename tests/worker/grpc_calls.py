"""What the tests of running workers (tests/worker/test_workers.py) send a worker over
gRPC, and how they wait on it: Generate collected into tokens with its final message
checked, the leak check (nothing queued or running, every block free), an engine loop
frozen on purpose, a line in a worker's log, a request held by a given prefill worker.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from bench.harness.tiny_models import VOCAB
from bench.harness.worker_procs import WorkerProc, wait_idle, wait_until
from rpc import pdserve_pb2 as pb

RPC_TIMEOUT_S = 60.0


class Result(NamedTuple):
    tokens: list[int]
    finish: int  # pb.FinishReason
    usage: pb.Usage


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def generate_request(prompt: list[int], max_tokens: int, prefill: list[str] = (), rid: str = "",
                     **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, prefill_workers=list(prefill),
                              params=pb.SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, **params}))


def generate(d: WorkerProc, prompt: list[int], max_tokens: int = 8, prefill: list[str] = (), rid: str = "",
             **params) -> Result:
    tokens, final = [], None
    for msg in d.stub.Generate(generate_request(prompt, max_tokens, prefill, rid, **params), timeout=RPC_TIMEOUT_S):
        assert final is None, "a message after the final one"
        tokens.extend(msg.token_ids)
        if msg.finish_reason != pb.FINISH_NONE:
            final = msg
    assert final is not None, "the stream ended without a final message"
    assert final.error.code == pb.ERROR_NONE, final.error
    assert final.usage.completion_tokens == len(tokens)
    assert final.usage.prompt_tokens == len(prompt)
    return Result(tokens, final.finish_reason, final.usage)


def assert_idle(*ws: WorkerProc) -> None:
    for w in ws:
        s = wait_idle(w)
        assert (s.waiting_requests, s.running_requests, s.free_blocks) == (0, 0, s.total_blocks), \
            f"{w.role} worker {w.address} did not come back to idle: {s}\n{w.log_tail()}"


def rpc_error(start_stream) -> grpc.RpcError:
    """Start a stream that must fail (it does on its first read); return its error."""
    with pytest.raises(grpc.RpcError) as info:
        list(start_stream())
    return info.value


@contextlib.contextmanager
def stalled(stall_file: Path):
    """Freeze a worker's engine loop (its PDSERVE_FAULT_STALL_FILE) for the block.

    The loop checks the file once per iteration, and a command that reaches an idle loop
    runs in the iteration that was already past the check: the short wait lets the loop
    come round to it before the block sends anything.
    """
    stall_file.touch()
    try:
        time.sleep(0.1)
        yield
    finally:
        stall_file.unlink(missing_ok=True)


def wait_logged(w: WorkerProc, text: str, timeout_s: float = 10.0) -> None:
    wait_until(lambda: text in w.log_path.read_text(errors="replace"), timeout_s, f"{text!r} in {w.role}'s log")


def generate_held_by(d: WorkerProc, holder: WorkerProc, prompt: list[int], prefill: list[str], rid: str):
    """Start generate() on a thread; return once the prefill worker `holder` has taken the
    prompt, with a function that joins the thread (bounded) and returns its Result."""
    box: dict[str, object] = {}

    def run():
        try:
            box["result"] = generate(d, prompt, prefill=prefill, rid=rid)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: (s := holder.stats()).running_requests + s.waiting_requests > 0, 20,
               f"{holder.address} to take request {rid}")

    def result() -> Result:
        t.join(RPC_TIMEOUT_S)
        assert not t.is_alive(), f"request {rid}: Generate hung"
        assert "error" not in box, box.get("error")
        return box["result"]

    return result
