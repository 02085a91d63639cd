"""The native CPU prefill attention (kernels/csrc/paged_prefill.cpp) against the torch
reference (gather + SDPA) on random inputs: chunks with and without a cached prefix, from one
token to a few hundred, float32 and bfloat16, grouped-query shapes, pools viewed out of a
block-major tensor (as engine/kv_cache.py lays them out), at every ISA level this host runs;
shapes it does not take go to the reference, with the same result."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import native, native_ops, reference

LEVELS = native.runnable_levels()
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (new tokens, context length) per chunk: a whole short prompt, chunks over a cached prefix
# (one mid-block, one on a block boundary), a one-token tail, a long chunk over a long prefix.
CHUNKS = [(5, 5), (37, 100), (16, 64), (1, 17), (128, 128), (2, 33), (100, 400)]


def _case(dtype, heads, kv_heads, head_dim, block_size, chunks, seed, layers=3):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-ctx // block_size) for _, ctx in chunks)
    pool = torch.randn(need + 8, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # one layer of a block-major pool
    perm = list(range(need + 8))
    rng.shuffle(perm)
    tables, cu, lens = [], [0], []
    for num_new, ctx in chunks:
        n = -(-ctx // block_size)
        tables.append(torch.tensor(perm[:n], dtype=torch.int64))
        perm = perm[n:]
        cu.append(cu[-1] + num_new)
        lens.append(ctx)
    tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    q = torch.randn(cu[-1], heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(cu), torch.tensor(lens), tables


def _reference(q, k_cache, v_cache, cu, lens, tables, scale):
    return reference.paged_prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, lens, tables,
                                             int((cu[1:] - cu[:-1]).max()), scale)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# SmolLM2's (9, 3, 64); head_dim 128 with 4 query heads per KV head; 7 per KV head (rows not a
# multiple of the vector width); no grouping; a block of 32
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 2, 128, 16), (7, 1, 64, 16), (4, 4, 64, 16), (9, 3, 64, 32)])
def test_native_prefill_attention_matches_the_reference(libraries, level, dtype, heads, kv_heads, head_dim,
                                                         block_size):
    q, k_cache, v_cache, cu, lens, tables = _case(dtype, heads, kv_heads, head_dim, block_size, CHUNKS,
                                                  seed=heads * 100 + head_dim + block_size)
    scale = head_dim ** -0.5
    want = _reference(q, k_cache, v_cache, cu, lens, tables, scale)
    got = native.paged_prefill_attention(libraries[level], q, k_cache, v_cache, cu, lens, tables, scale)
    if level == "generic":  # no vector ISA: the kernel declines, the op set runs the reference
        assert got is None
        return
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "generic"])
def test_peaked_scores_keep_the_online_softmax_exact(libraries, level):
    """Scores that span ~100 nats, the max in a late block: every earlier block's weights are
    rescaled to the new max and must still sum right; the peak is causal (rows before it
    never see it)."""
    q, k_cache, v_cache, cu, lens, tables = _case(torch.float32, 9, 3, 64, 16, [(40, 300)], seed=11)
    q *= 4
    peak = 290  # a position inside the chunk (positions 260-299): only later rows see it
    k_cache[tables[0, peak // 16], peak % 16] = 3 * q[35].view(3, 3, 64).mean(1)
    want = _reference(q, k_cache, v_cache, cu, lens, tables, 0.125)
    got = native.paged_prefill_attention(libraries[level], q, k_cache, v_cache, cu, lens, tables, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_reference(libraries, threads):
    level = LEVELS[-1]
    q, k_cache, v_cache, cu, lens, tables = _case(torch.float32, 9, 3, 64, 16, CHUNKS, seed=threads)
    want = _reference(q, k_cache, v_cache, cu, lens, tables, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.paged_prefill_attention(libraries[level], q, k_cache, v_cache, cu, lens, tables, 0.125)
    finally:
        torch.set_num_threads(before)
    assert got is not None or level == "generic"
    if got is not None:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernel_does_not_take_go_to_the_reference(libraries, monkeypatch):
    """head_dim 32, float64, a chunk longer than its context: the kernel declines (None) and
    the native op set answers with the reference's numbers (or its error)."""
    lib = libraries[LEVELS[-1]]
    monkeypatch.setattr(native_ops, "_lib", lib)
    for dtype, head_dim in ((torch.float32, 32), (torch.float64, 64)):
        q, k_cache, v_cache, cu, lens, tables = _case(dtype, 9, 3, head_dim, 16, CHUNKS[:3], seed=5)
        assert native.paged_prefill_attention(lib, q, k_cache, v_cache, cu, lens, tables, 0.2) is None
        got = native_ops.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 37, 0.2)
        want = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 37, 0.2)
        torch.testing.assert_close(got, want)
    q, k_cache, v_cache, cu, lens, tables = _case(torch.float32, 9, 3, 64, 16, [(5, 5)], seed=6)
    assert native.paged_prefill_attention(lib, q, k_cache, v_cache, cu, lens - 1, tables, 0.2) is None
