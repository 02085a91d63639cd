"""A decode worker whose model is sharded over two ranks (`--tensor-parallel-size 2`,
aggregated): over gRPC it gives the offline engine's greedy tokens at one rank, and when a
rank is killed (kill -9) the whole worker ends at once, idle or mid-stream, so that the
deployment replaces the group: the stream in flight ends with an error, nothing hangs,
and the group's other processes go with it."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import start_workers, wait_until
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2 as pb
from tests.worker.grpc_calls import RPC_TIMEOUT_S, assert_idle, generate, generate_request, random_prompt, wait_logged
from worker.exit_codes import RANK_LOST

ARGS = ["--no-transfer", "--tensor-parallel-size", "2", "--dtype", "float32", "--kv-blocks", "64",
        "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", seed=7)


def _offline(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine.from_folder(model, "float32", CacheConfig(block_size=16, num_blocks=64),
                                   SchedulerConfig(max_num_batched_tokens=32, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def _rank_pids(worker) -> list[int]:
    wait_logged(worker, "tensor-parallel group of 2 ranks")
    line = re.search(r"ranks 1\.\. are pids ([\d ]+)", worker.log_path.read_text()).group(1)
    return [int(p) for p in line.split()]


def _sample(exposition: str, name: str, rank: str) -> float:
    return float(re.search(rf'^{name}{{rank="{rank}"}} (\S+)$', exposition, re.MULTILINE).group(1))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    return state == "Z"  # ended, not yet reaped by its parent


def test_two_rank_worker_serves_one_ranks_tokens_and_ends_whole_when_a_rank_dies(model, tmp_path):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (5, 40, 17, 70)]  # two are prefilled in chunks
    want = _offline(model, prompts, 12)
    (d,) = start_workers([("decode", ARGS, {})], model, tmp_path, timeout_s=180)
    try:
        pids = _rank_pids(d)
        with ThreadPoolExecutor(len(prompts)) as pool:  # batched together, as served
            got = list(pool.map(lambda p: generate(d, p, 12, ignore_eos=True).tokens, prompts))
        assert got == want
        assert_idle(d)
        series = d.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition.decode()
        steps = {r: _sample(series, "pdserve_engine_tp_steps_total", r) for r in ("0", "1")}
        assert steps["0"] > 0 and steps["1"] > 0, series  # both ranks ran the steps (rank 1 may trail by one)
        for r in ("0", "1"):
            assert 0 < _sample(series, "pdserve_engine_tp_collective_seconds_total", r) \
                < _sample(series, "pdserve_engine_tp_step_seconds_total", r)

        first, stream_error = threading.Event(), {}

        def long_stream():
            try:
                for msg in d.stub.Generate(generate_request(prompts[0], 400, ignore_eos=True), timeout=RPC_TIMEOUT_S):
                    if msg.token_ids:
                        first.set()
                    stream_error["error"] = msg.error.code  # the last message's: an error if the loop saw it first
            except grpc.RpcError as e:
                stream_error["error"] = e.code()

        t = threading.Thread(target=long_stream)
        t.start()
        assert first.wait(RPC_TIMEOUT_S)
        os.kill(pids[0], signal.SIGKILL)
        assert d.proc.wait(timeout=60) == RANK_LOST
        t.join(RPC_TIMEOUT_S)
        assert not t.is_alive()
        # ended with the worker (the call cut), or, when the loop's failed step came before the
        # exit, with an error in its last message: never finished as if nothing happened
        assert stream_error["error"] not in (None, pb.ERROR_NONE), stream_error
        assert f"rank 1 is gone (pid {pids[0]}, exit code -9)" in d.log_path.read_text()
        wait_until(lambda: all(_gone(p) for p in pids), 30, "the group's processes ended")
    finally:
        d.stop()


def test_a_rank_slower_than_its_group_is_named_by_deep_health(model, tmp_path):
    """Rank 1 stretched to 4x its compute (envs.fault_slow_rank): deep checks every 5 tokens
    of a long generation (several callers on a slow host: each gateway process, the
    controller) name it once 3 whole windows of 20 steps have run; none names rank 0. (A
    check used to consume its window, so checks this frequent never named anyone.)"""
    (d,) = start_workers([("decode", ARGS, {"PDSERVE_FAULT_SLOW_RANK": "1:4"})], model, tmp_path, timeout_s=180)
    try:
        stream = d.stub.Generate(generate_request(random_prompt(random.Random(5), 8), 400, ignore_eos=True),
                                 timeout=RPC_TIMEOUT_S * 4)
        verdicts, seen = [], 0
        for msg in stream:
            seen += len(msg.token_ids)
            if seen >= 5 * (len(verdicts) + 1):
                verdicts.append(d.stub.Health(pb.HealthRequest(deep=True), timeout=10))
                if verdicts[-1].straggler:
                    break
        stream.cancel()
        assert all(v.ok for v in verdicts)  # slow is not wedged
        named = [v.straggler for v in verdicts if v.straggler]
        assert named and named[0].startswith("rank 1 computes"), [v.straggler for v in verdicts]
        assert named[0].endswith("in 3 windows in a row")
    finally:
        d.stop()
