"""The planner's simulator makes the engine's own scheduling decisions: a real engine (a
tiny random-weight model, a KV pool small enough to preempt) runs requests that arrive
between steps, one of them prefilled remotely (its KV handed in by hand), and every step's
decisions are logged as JSON lines; the log's inputs replayed through deploy/planner/sim_worker.py
give the same decisions, step for step: which chunks of which requests, which requests
preempted, which blocks reserved for remote KV."""

from __future__ import annotations

import json
import random

import pytest

from bench.harness.tiny_models import VOCAB, write_tiny_checkpoint
from deploy.planner.profile import Profile
from deploy.planner.sim_worker import SIM_TOKEN, SimWorker, StepShape
from deploy.planner.simulator import Pools, simulate
from engine import LLMEngine, SamplingParams
from engine.config import CacheConfig, SchedulerConfig

BLOCK = 8
BLOCKS = 24  # 192 tokens: three or four requests at once, then preemption
SCHED = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6, max_model_len=400)


def _arrivals() -> list[dict]:
    """(step, request) pairs: prompts of 5-90 tokens, outputs of 1-40, a remote prefill."""
    rng = random.Random(7)
    out = []
    for i in range(14):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 90))]
        out.append({"step": rng.randrange(0, 40), "id": f"r{i}", "prompt": prompt, "max_tokens": rng.randrange(1, 40),
                    "remote": i == 5})
    return sorted(out, key=lambda a: a["step"])


def _decisions(out) -> dict:
    return {"chunks": [[c.seq.request_id, c.start, c.num_new] for c in out.chunks],
            "preempted": list(out.preempted),
            "reserved": [[rp.seq.request_id, rp.block_table] for rp in out.remote_prefills]}


def _run_real(engine: LLMEngine, arrivals: list[dict]) -> list[dict]:
    """Step the engine as a worker would; the log: each step's inputs and decisions."""
    log, pending, step, awaiting = [], list(arrivals), 0, {}
    while pending or engine.has_unfinished():
        added = [a for a in pending if a["step"] <= step]
        pending = [a for a in pending if a["step"] > step]
        for a in added:
            engine.add_request(a["id"], a["prompt"], SamplingParams(temperature=0, max_tokens=a["max_tokens"],
                                                                    ignore_eos=True), remote_prefill=a["remote"])
        kv_ready = [rid for rid, due in awaiting.items() if due <= step]  # the remote KV lands 3 steps later
        for rid in kv_ready:
            del awaiting[rid]
            engine.remote_kv_ready(rid, SIM_TOKEN)
        out = engine.schedule()
        for rp in out.remote_prefills:
            awaiting[rp.seq.request_id] = step + 3
        log.append({"step": step, "added": [a["id"] for a in added], "kv_ready": kv_ready, **_decisions(out)})
        engine.execute(out)
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return log


def test_the_simulator_schedules_a_logged_trace_as_the_engine_did(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(BLOCK, BLOCKS), SCHED)
    arrivals = _arrivals()
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in _run_real(engine, arrivals)))
    logged = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["preempted"] for s in logged), "the trace should exercise preemption"
    assert any(s["reserved"] for s in logged) and any(len(s["chunks"]) > 2 for s in logged)

    by_id = {a["id"]: a for a in arrivals}
    sim = SimWorker("decode-0", SCHED, BLOCKS, BLOCK)
    for entry in logged:
        for rid in entry["added"]:
            a = by_id[rid]
            sim.add(rid, a["prompt"], a["max_tokens"], remote_prefill=a["remote"])
        for rid in entry["kv_ready"]:
            sim.scheduler.remote_kv_ready(rid, SIM_TOKEN)
        out, _, _ = sim.step()
        assert _decisions(out) == {k: entry[k] for k in ("chunks", "preempted", "reserved")}, f"step {entry['step']}"
    assert not sim.has_work()


def test_step_shapes_group_decodes_and_chunks_as_the_runner_does(tmp_path):
    sim = SimWorker("w", SCHED, BLOCKS, BLOCK)
    sim.add("a", list(range(3, 20)), 4)
    sim.add("b", list(range(30, 100)), 4)
    _, shape, _ = sim.step()
    assert shape == StepShape((), ((0, 17), (0, 31)), 1)  # a whole (sampled), b's capped chunk topped up
    _, shape, _ = sim.step()
    assert shape == StepShape((18,), ((31, 39),), 2)  # a decodes at its context, b ends its prompt


def test_a_request_preempted_in_the_simulator_still_finishes():
    """Long outputs that cannot all fit: the engine's preemption by recompute in the pools."""
    p = Profile("m", "float32", 1, BLOCK, 48, BLOCKS * BLOCK, prefill_coef=[0.01, 1e-4, 1e-7],
                decode_coef=[0.01, 1e-4, 1e-7])
    reqs = simulate(p, Pools(0, 1), [(0.0, 40, 100), (0.0, 40, 100), (0.01, 40, 100)])
    assert all(r.finish < float("inf") and len(r.token_times) == 99 for r in reqs)
    with pytest.raises(ValueError, match="KV capacity"):
        simulate(p, Pools(1, 1), [(0.0, 150, 100)])
