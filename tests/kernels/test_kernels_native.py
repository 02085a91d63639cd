"""The native CPU decode attention (kernels/csrc/paged_decode.cpp) against the torch
reference on random inputs: float32 and bfloat16, grouped-query shapes, block sizes,
contexts from one token to several hundred, pools viewed out of a block-major tensor (as
engine/kv_cache.py lays them out), at every ISA level this host can run."""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels import native, native_ops, reference
from kernels.attention_step import StepDecodes

LEVELS = native.runnable_levels()
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("level", LEVELS)
# bf16 scores with AVX512-BF16 dot instructions where the CPU has them, and on widened rows
@pytest.mark.parametrize("dtype,dots", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
# (9, 3, 64, 16) and (8, 2, 128, 32) take the vector path (decode_simd) where the level has one;
# head_dim 32, 16 query heads per KV head, or (AVX-512) a block of 8 take the plain loops.
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 32), (16, 1, 64, 16), (6, 2, 64, 8)])
def test_native_decode_attention_matches_the_reference(libraries, level, dtype, dots, heads, kv_heads, head_dim,
                                                        block_size):
    rng = random.Random(hash((level, str(dtype), heads, head_dim)) & 0xFFFF)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    num_blocks = 96
    pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)  # block-major
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    lens = [1, 2, block_size, block_size + 1, 37, 300, rng.randrange(1, 400)]
    width = max(-(-n // block_size) for n in lens)
    perm = list(range(num_blocks))
    tables = []
    for n in lens:
        rng.shuffle(perm)
        tables.append(perm[:width])
    tables = torch.tensor(tables, dtype=torch.int64)
    context_lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    want = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, context_lens,
                                            scale)
    got = native.paged_decode_attention(libraries[level], q, k_cache, v_cache, tables, context_lens, scale,
                                        dots=dots)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("level", LEVELS)
def test_peaked_scores_keep_the_online_softmax_exact(libraries, level):
    """Scores that span ~100 nats, their max in a late chunk: every earlier chunk's weights
    are rescaled to the new max (the vector path's running max) and must still sum right."""
    gen = torch.Generator().manual_seed(7)
    block_size, kv_heads, head_dim = 16, 3, 64
    pool = torch.randn(40, 2, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    tables = torch.arange(40, dtype=torch.int64)[None].repeat(2, 1)
    q = 4 * torch.randn(2, 9, head_dim, generator=gen)
    k_cache[tables[0, 30], 5] = 3 * q[0].view(kv_heads, 3, head_dim).mean(1)  # the peak: position 485
    lens = torch.tensor([600, 487], dtype=torch.int64)
    want = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.125)
    got = native.paged_decode_attention(libraries[level], q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lens", [[700], [5, 650], [1, 33, 2, 400]])
def test_small_batches_split_each_context_across_threads(libraries, level, threads, lens):
    """With fewer sequences than threads have work, each context is cut into parts (some
    empty where a context is short) whose softmax states are merged: still the reference."""
    gen = torch.Generator().manual_seed(len(lens) * 10 + threads)
    block_size, kv_heads, head_dim = 16, 3, 64
    pool = torch.randn(48, 2, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    tables = torch.stack([torch.randperm(48, generator=gen)[:44] for _ in lens])
    q = torch.randn(len(lens), 9, head_dim, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int64)
    want = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, context_lens,
                                            0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.paged_decode_attention(libraries[level], q, k_cache, v_cache, tables, context_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernel_cannot_take_are_refused(libraries):
    lib = libraries[LEVELS[-1]]
    k = torch.zeros(4, 16, 3, 64)
    with pytest.raises(ValueError, match="refused the shapes"):  # 8 heads over 3 KV heads
        native.paged_decode_attention(lib, torch.zeros(1, 8, 64), k, k, torch.zeros(1, 1, dtype=torch.int64),
                                      torch.ones(1, dtype=torch.int64), 1.0)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        native.paged_decode_attention(lib, torch.zeros(1, 3, 64, dtype=torch.float16), k.half(), k.half(),
                                      torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1.0)


def test_pdserve_kernels_native_selects_the_native_op_set(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "native")
    assert kernels.get_ops("cpu") is native_ops.OPS
    # in place: the step's decodes are one group, read up to each context length (no mask)
    decodes = StepDecodes(torch.tensor([[1, 0], [3, 4]]), torch.tensor([3, 8]), [3, 8], [1, 2], 4)
    (group,) = native_ops.OPS.plan_decodes(decodes, "cpu")
    assert (group.start, group.end, group.mask) == (0, 2, None)
    with pytest.raises(ValueError, match="for CPU tensors"):
        kernels.get_ops("cuda")
    q = torch.randn(2, 4, 16, dtype=torch.float64)  # float64 (tests' exact dtype): the reference serves it
    k = torch.randn(8, 4, 2, 16, dtype=torch.float64)
    tables, lens = torch.tensor([[1, 2], [3, 4]]), torch.tensor([5, 8])
    torch.testing.assert_close(native_ops.paged_decode_attention(q, k, k, tables, lens, 0.25),
                               reference.paged_decode_attention(q, k, k, tables, lens, 0.25))


def test_auto_takes_the_native_op_set_on_cpu_and_the_torch_ops_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    kernels._native_ops.cache_clear()
    assert kernels.get_ops("cpu") is native_ops.OPS
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    kernels._native_ops.cache_clear()
    try:
        assert kernels.get_ops("cpu") is reference.OPS
        monkeypatch.setenv("PDSERVE_KERNELS", "native")
        with pytest.raises(RuntimeError, match="cannot be built here"):
            kernels.get_ops("cpu")
    finally:
        kernels._native_ops.cache_clear()


def test_the_engine_gives_the_same_greedy_tokens_through_the_native_op_set(tmp_path, monkeypatch):
    """float32, a tiny random model, a batch of prompts of mixed lengths decoded together:
    the same tokens through the native decode attention as through the torch ops."""
    from common.sampling_params import SamplingParams
    from engine.config import CacheConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from bench.harness.tiny_models import VOCAB, write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa", seed=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 40, 90)]
    outputs = {}
    for choice in ("torch", "native"):
        monkeypatch.setenv("PDSERVE_KERNELS", choice)
        engine = LLMEngine.from_folder(folder, "float32", CacheConfig(16, 64), SchedulerConfig(64, 8, 512))
        assert engine.runner.model.ops is (native_ops.OPS if choice == "native" else reference.OPS)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
        outputs[choice] = tokens
    assert outputs["native"] == outputs["torch"]
