"""A worker process changes role in place (deploy/role_process.py, worker/role_change.py):
real worker processes and gateways, KV over NIXL, SmolLM2 in float32.

One process started as a decode worker serves a request, is drained, becomes a prefill
worker (a new KV pool and agent over the weights it loaded once) whose KV another decode
worker decodes from, then becomes a decode worker again: the same greedy text each time,
the same process, one weight load.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref

import grpc
import httpx
import pytest

from bench.harness.gateway_procs import gateway, metric_value
from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO, WorkerProc, start_workers, wait_idle
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2 as pb

ARGS = ["--dtype", "float32", "--kv-blocks", "256"]
PROMPT = "The capital of France is"
READY_GUARD_S = 180  # a guard against a hang, not a speed bound


def _greedy_tokens(engine: LLMEngine, rid: str) -> list[int]:
    engine.add_request(rid, list(range(3, 40)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids


def test_an_engine_over_another_engines_weights_has_its_own_pool_and_the_same_tokens(tmp_path):
    model = write_tiny_checkpoint(tmp_path, "llama-gqa", seed=5)
    first = LLMEngine.from_folder(model, "float32", CacheConfig(16, 64), SchedulerConfig(64, 8, 512))
    expected = _greedy_tokens(first, "a")
    first.add_request("busy", [3, 4, 5], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="holding 1 requests"):
        first.over_weights_of(CacheConfig(16, 32), SchedulerConfig(128, 4, 512))
    first.abort_request("busy")
    weights, pool = first.model, weakref.ref(first.kv_cache)
    second = first.over_weights_of(CacheConfig(16, 32), SchedulerConfig(128, 4, 512))
    gc.collect()
    assert pool() is None  # the first pool is freed, not kept beside the new one
    assert second.model is weights and second.num_kv_blocks == 32 and second.config.scheduler.max_num_seqs == 4
    assert _greedy_tokens(second, "b") == expected
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        second.over_weights_of(CacheConfig(16, 32), SchedulerConfig(128, 4, 10**6))


def _ready_address(log, name: str, proc: subprocess.Popen, timeout_s: float = READY_GUARD_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(f"{name} ready on "):
                return line.rsplit(" ", 1)[-1]
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{name} not ready in {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def movable(smollm2_dir, tmp_path_factory):
    """(the role-changing process, started as decode worker 50; a prefill and a decode
    worker started as `python -m <role>`; the log folder)."""
    logs = tmp_path_factory.mktemp("role")
    log = logs / "movable.log"
    cmd = [sys.executable, "-m", "deploy.role_process", "--role", "decode", "--model", str(smollm2_dir), "--port", "0",
           "--threads", "1", "--worker-id", "50", "--incarnation", "1", *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    others = []
    try:
        others = start_workers([("prefill", ARGS, {}), ("decode", ARGS, {})], smollm2_dir, logs, timeout_s=120)
        movable = WorkerProc("decode", proc, log, _ready_address(log, "decode-50-1", proc))
        yield movable, others[0], others[1], logs
    finally:
        for w in others:
            w.stop()
        WorkerProc("decode", proc, log).stop()


def _greedy(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _change(worker: WorkerProc, role: str, worker_id: str, incarnation: int, args: list[str]) -> None:
    worker.stub.ChangeRole(pb.ChangeRoleRequest(role=role, worker_id=worker_id, incarnation=incarnation, args=args),
                           timeout=30)


def test_a_drained_worker_changes_role_in_place_and_serves_the_same_tokens(movable, smollm2_dir):
    worker, prefill, decode, logs = movable
    pid = worker.proc.pid
    with gateway(smollm2_dir, [worker.address], [prefill.address], logs / "gw1.log") as url:
        expected = _greedy(url)  # prefilled by the prefill worker, decoded by the movable one
    assert expected.strip()

    # Refused while it takes requests; a plain `python -m decode` cannot change role at all.
    with pytest.raises(grpc.RpcError) as refused:
        _change(worker, "prefill", "60", 2, ARGS)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "drain it first" in refused.value.details()
    with pytest.raises(grpc.RpcError) as plain:
        _change(decode, "prefill", "61", 2, ARGS)
    assert plain.value.code() is grpc.StatusCode.UNIMPLEMENTED and "deploy.role_process" in plain.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        _change(worker, "router", "62", 2, ARGS)
    assert unknown.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "unknown role" in unknown.value.details()

    # Drained (it holds nothing), it becomes prefill worker 60 with a pool of its own size.
    assert worker.stub.Drain(pb.DrainRequest(), timeout=30).holds_nothing
    _change(worker, "prefill", "60", 2, ["--dtype", "float32", "--kv-blocks", "96"])
    old_address = worker.address
    as_prefill = WorkerProc("prefill", worker.proc, worker.log_path,
                            _ready_address(worker.log_path, "prefill-60-2", worker.proc))
    assert as_prefill.address != old_address and as_prefill.proc.pid == pid
    assert as_prefill.stats().total_blocks == 96
    with pytest.raises(grpc.RpcError):  # the decode worker it was serves no more
        pb_stub = WorkerProc("decode", worker.proc, worker.log_path, old_address).stub
        pb_stub.Health(pb.HealthRequest(), timeout=5)

    with gateway(smollm2_dir, [decode.address], [as_prefill.address], logs / "gw2.log") as url:
        assert _greedy(url) == expected  # its KV, pushed over NIXL from the new agent, decoded elsewhere
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    pushed = metric_value(metrics, "pdserve_kv_transfer_bytes_total", peer_role="decode", role="prefill",
                          worker="prefill-60-2")
    assert pushed > 0, metrics  # the KV left the new agent, over NIXL
    s = wait_idle(as_prefill)
    assert s.free_blocks == s.total_blocks

    # And back: decode worker 70, its KV written by the other prefill worker.
    assert as_prefill.stub.Drain(pb.DrainRequest(), timeout=30).holds_nothing
    _change(as_prefill, "decode", "70", 3, ARGS)
    again = WorkerProc("decode", worker.proc, worker.log_path,
                       _ready_address(worker.log_path, "decode-70-3", worker.proc))
    with gateway(smollm2_dir, [again.address], [prefill.address], logs / "gw3.log") as url:
        assert _greedy(url) == expected
    assert again.proc.pid == pid and again.stats().total_blocks == 256

    text = worker.log_path.read_text()
    assert text.count("(weights loaded)") == 1 and text.count("(weights kept)") == 2, text[-3000:]
    assert "becoming prefill worker 60 over the same weights" in text
    again.proc.terminate()  # a role-changed process still shuts down cleanly on SIGTERM
    assert again.proc.wait(60) == 0, again.log_tail()
