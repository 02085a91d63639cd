"""The engine through the Triton op set (PDSERVE_KERNELS=triton, Triton's interpreter on CPU)
against the same engine through the torch references, on a tiny random-weight model.

Greedy tokens must be identical, and so must a seeded sampled request's (both op sets
hash the same (seed, position, token) draws). The run covers what the batched kernels
add: decodes and prefill chunks in one step, chunked prefill over a cached prefix,
prefix-cache hits, and split-free as well as multi-tile contexts.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and so triton) are first imported

import pytest
import torch

from bench.harness.tiny_models import VOCAB, write_tiny_checkpoint
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler, SamplingMetadata
from kernels import reference as ref
from kernels import triton_ops


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama-gqa"), "llama-gqa", seed=4)


def _generate(folder, kernels: str, monkeypatch) -> tuple[dict[str, list[int]], LLMEngine]:
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    cache = CacheConfig(block_size=8, num_blocks=48)
    engine = LLMEngine.from_folder(folder, "float32", cache,
                                   SchedulerConfig(max_model_len=256, max_num_batched_tokens=16))
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, VOCAB, (19,), generator=g).tolist()  # two full blocks to share
    prompts = [shared + [5, 6], shared, torch.randint(3, VOCAB, (40,), generator=g).tolist(), [7],
               torch.randint(3, VOCAB, (11,), generator=g).tolist()]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=123, max_tokens=10,
                            ignore_eos=True)
    outs: dict[str, list[int]] = {}

    def run(batch):
        for rid, prompt, params in batch:
            engine.add_request(rid, prompt, params)
            outs[rid] = []
        while engine.has_unfinished():
            for d in engine.step():
                outs[d.request_id].extend(d.token_ids)

    run([("first", prompts[0], greedy)])  # fills the prefix cache for the next round
    run([(f"r{i}", p, seeded if i == 2 else greedy) for i, p in enumerate(prompts)])
    assert engine.kv_manager.prefix_cache_hit_rate > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    return outs, engine


def test_engine_tokens_are_the_same_through_the_triton_ops(tiny_folder, monkeypatch):
    expect, engine = _generate(tiny_folder, "torch", monkeypatch)
    assert engine.model.ops is ref.OPS
    got, engine = _generate(tiny_folder, "triton", monkeypatch)
    assert engine.model.ops is triton_ops.OPS
    assert got == expect


def test_sampler_through_the_triton_ops_matches_the_cpu_sampler(monkeypatch):
    """Greedy and seeded rows give the CPU sampler's tokens; unseeded rows stay in the support."""
    g = torch.Generator().manual_seed(3)
    vocab = 300
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=30, seed=1),
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.5, logit_bias={5: 4.0}),  # unseeded
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.9, min_p=0.1),  # unseeded
    ]
    prompts = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(0, vocab, (i,), generator=g).tolist() for i in range(len(params))]
    logits = torch.randn(len(params), vocab, generator=g) * 2
    meta = SamplingMetadata.build(params, prompts, outputs, vocab, "cpu")
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    expect = Sampler()(logits, meta).token_ids
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    got = Sampler(torch.Generator().manual_seed(0))(logits, meta).token_ids
    for i in (0, 1, 2, 4):
        assert got[i] == expect[i], f"row {i}"
    from engine.sampler import process_logits

    processed = process_logits(logits, meta)
    top_k = torch.tensor([0, 30, 0, 10, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.5, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1])
    keep = ref.sampling_mask(processed, meta.temperature, top_k, top_p, min_p)
    assert keep[3, got[3]] and keep[5, got[5]]


@pytest.mark.parametrize("kind", ["qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_a_mixture_of_experts_gives_the_same_tokens_through_the_triton_experts(kind, tmp_path, monkeypatch):
    """Qwen3-MoE through the Triton op set (the experts stacked once, two grouped matmuls a
    layer) against the same engine through the references (a loop over experts); gpt-oss's
    biased, clamped experts and its sinks and windows take the op set's torch fallbacks."""
    folder = write_tiny_checkpoint(tmp_path / kind, kind, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 1, 30)]
    outs = {}
    for kernels_name in ("torch", "triton"):
        monkeypatch.setenv("PDSERVE_KERNELS", kernels_name)
        engine = LLMEngine.from_folder(folder, "float32", CacheConfig(block_size=8, num_blocks=32),
                                       SchedulerConfig(max_model_len=256, max_num_batched_tokens=16))
        got = {f"r{i}": [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy)
        while engine.has_unfinished():
            for d in engine.step():
                got[d.request_id].extend(d.token_ids)
        moe = next(layer.moe for layer in engine.model.layers if layer.moe is not None)
        # laid out for the backend that reads it
        assert (moe.stacked is not None) == (kernels_name == "triton" and moe.plain)
        outs[kernels_name] = got
    assert outs["triton"] == outs["torch"]
