"""Our model against Hugging Face transformers on tiny random checkpoints (float64).

Logits over a varlen batch through the paged pool, and greedy generation through the
whole engine (continuous batching, chunked prefill, prefix cache, preemption), must match
transformers' own forward and `generate`.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.tiny_models import KINDS, VOCAB, load_hf, write_tiny_checkpoint
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.kv_cache import KVCache
from engine.llm_engine import LLMEngine
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from engine.weights import load_weights


@pytest.fixture(scope="module", params=sorted(KINDS))
def tiny(request, tmp_path_factory):
    kind = request.param
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=sorted(KINDS).index(kind))
    return folder, load_hf(folder)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 1, 33, 64, 9, 23][:n]
    return [torch.randint(3, VOCAB, (L,), generator=g).tolist() for L in lengths]


def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=2, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    return gen[: gen.index(2) + 1] if 2 in gen else gen


def test_logits_match_hf_over_a_varlen_batch(tiny):
    folder, hf = tiny
    cfg = ModelConfig.from_pretrained(folder)
    model = CausalLM(cfg, torch.float64)
    load_weights(model, folder)
    kv = KVCache(cfg, num_blocks=40, block_size=16, dtype=torch.float64)
    runner = ModelRunner(model, kv)
    prompts = _prompts(4)
    # Scattered, non-contiguous block tables, one per sequence.
    tables, free = [], list(range(39, -1, -1))
    chunks = []
    for i, p in enumerate(prompts):
        table = [free.pop() for _ in range(-(-len(p) // 16))]
        tables.append(table)
        seq = Sequence(f"r{i}", p, SamplingParams())
        chunks.append(ScheduledChunk(seq, 0, len(p), table))
    chunks.sort(key=lambda c: c.num_new > 1)
    out = SchedulerOutput(chunks)
    step = runner.prepare(out)
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, kv.layers, step.attention)
        ours = model.compute_logits(hidden).double()
        start = 0
        for chunk in chunks:
            ref = hf(torch.tensor([chunk.token_ids])).logits[0]
            got = ours[start:start + chunk.num_new]
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
            start += chunk.num_new


def _engine(folder, **sched) -> LLMEngine:
    cache = CacheConfig(block_size=16, num_blocks=sched.pop("num_blocks", 64))
    return LLMEngine.from_folder(folder, "float64", cache, SchedulerConfig(max_model_len=512, **sched))


def _run(engine: LLMEngine, prompts, params: SamplingParams) -> dict[str, list[int]]:
    outs = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for d in engine.step():
            outs[d.request_id].extend(d.token_ids)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    return outs


@pytest.mark.parametrize("budget", [512, 16])  # 16: prompts are cut into chunks beside decodes
def test_greedy_matches_hf_generate_in_one_batch(tiny, budget):
    folder, hf = tiny
    prompts = _prompts(8, seed=1)
    engine = _engine(folder, max_num_batched_tokens=budget)
    outs = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=12))
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == _hf_greedy(hf, p, 12), f"prompt {i} (len {len(p)})"


def test_greedy_matches_hf_with_prefix_cache_hits(tiny):
    folder, hf = tiny
    shared = _prompts(1, seed=2)[0] * 8  # 40 tokens: two full blocks to share
    prompts = [shared + [7, 8, 9], shared + [10], shared[:33]]
    engine = _engine(folder)
    first = _run(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=6))
    engine2_outs = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=6))
    assert engine.kv_manager.prefix_cache_hit_rate > 0
    assert first["r0"] == engine2_outs["r0"]
    for i, p in enumerate(prompts):
        assert engine2_outs[f"r{i}"] == _hf_greedy(hf, p, 6)


def test_greedy_matches_hf_after_preemption(tiny):
    folder, hf = tiny
    prompts = _prompts(6, seed=3)
    # 12 blocks of 16 tokens for 6 sequences growing to ~50-80 tokens: preemption is certain.
    engine = _engine(folder, num_blocks=12, max_num_batched_tokens=64)
    outs = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        ref = _hf_greedy_no_eos(hf, p, 24)
        assert outs[f"r{i}"] == ref, f"prompt {i}"


def _hf_greedy_no_eos(hf, prompt, max_new):
    """Greedy decoding with transformers' forward, never stopping at EOS (like ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
