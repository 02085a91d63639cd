"""Prefill and decode workers of different tensor-parallel degrees, as real processes over
gRPC and NIXL (tiny random Qwen3-MoE, 4 query and 2 KV heads, 8 experts split across the
ranks, float64: the KV is the attention's whatever the experts' split): 1 -> 1, 2 -> 1,
1 -> 2 and 2 -> 2 each give the offline engine's greedy tokens at one rank, and the KV
came from the prefill worker (the decode worker's first message names it and the blocks
that came over), with every block free on both sides afterwards. Equal degrees move whole
blocks rank to rank; different ones move each rank's heads (transfer/ranks.py)."""

from __future__ import annotations

import random

import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import start_workers
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2 as pb
from tests.worker.grpc_calls import RPC_TIMEOUT_S, assert_idle, generate_request, random_prompt

BLOCK = 16
ARGS = ["--dtype", "float64", "--kv-blocks", "64", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3-moe", seed=7)


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    """Prefill and decode workers at one and two ranks: {(role, degree): worker}."""
    specs = [(role, [*ARGS, "--worker-id", str(tp), "--tensor-parallel-size", str(tp)], {})
             for role in ("prefill", "decode") for tp in (1, 2)]
    started = start_workers(specs, model, tmp_path_factory.mktemp("logs"), timeout_s=240)
    yield {(role, tp): w for (role, tp), w in zip([(r, t) for r in ("prefill", "decode") for t in (1, 2)], started)}
    for w in started:
        w.stop()


def _offline(model, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(block_size=BLOCK, num_blocks=64),
                                   SchedulerConfig(max_num_batched_tokens=32, max_model_len=512))
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for delta in engine.step():
            out.extend(delta.token_ids)
    return out


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_kv_pushed_between_degrees_gives_one_ranks_tokens(workers, model, prefill_tp, decode_tp):
    p, d = workers["prefill", prefill_tp], workers["decode", decode_tp]
    prompt = random_prompt(random.Random(prefill_tp * 10 + decode_tp), 45)  # three blocks, prefilled in chunks
    tokens, served = [], []
    request = generate_request(prompt, 10, prefill=[p.address], ignore_eos=True)
    for msg in d.stub.Generate(request, timeout=RPC_TIMEOUT_S):
        tokens.extend(msg.token_ids)
        served += [msg.served] if msg.HasField("served") else []
        final = msg
    assert final.error.code == pb.ERROR_NONE, final.error
    assert tokens == _offline(model, prompt, 10)
    assert [(s.prefill_worker, s.local_prefill) for s in served] == [(p.address, pb.LOCAL_PREFILL_NONE)]
    assert served[0].kv_blocks == -(-len(prompt) // BLOCK)  # every block of the prompt came over
    assert_idle(p, d)
