"""Each Triton kernel against its torch reference (kernels/reference.py), in Triton's
interpreter on CPU.

Inputs are fresh random numbers (never zeros); outputs are NaN-poisoned before the run and
must come back fully written. KV pool slots no context covers are NaN too, and padded
block-table entries point at an all-NaN block, so a kernel that reads past a context or
through padding gives NaN. Shapes are small and blocks big: the interpreter costs about
half a millisecond per program.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and so triton) are first imported

import math

import pytest
import torch

import kernels
from engine.seeded_random import seeded_exponentials
from kernels import native_ops
from kernels import reference as ref
from kernels import triton_ops as tri

TOL = {  # output vs a float32 reference on the same (rounded) inputs
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


def test_the_interpreter_is_on_and_dispatch_follows_pdserve_kernels(monkeypatch):
    assert tri.INTERPRET
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    assert kernels.get_ops("cpu") is native_ops.OPS  # auto on CPU: the native op set where g++ builds it
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    assert kernels.get_ops("cpu") is tri.OPS
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    assert kernels.get_ops("cpu") is ref.OPS
    monkeypatch.setenv("PDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, torch, triton, native"):
        kernels.get_ops("cpu")


class PagedPool:
    """A block-major pool [num_blocks, layers, 2, block_size, kv_heads, head_dim] holding random
    contexts in shuffled blocks; block 0 (the padding id) and every unused slot are NaN."""

    def __init__(self, g, context_lens, block_size, kv_heads, head_dim, dtype, layers=2):
        self.block_size = block_size
        self.lens = context_lens
        n_blocks = [math.ceil(n / block_size) for n in context_lens]
        num_blocks = 1 + sum(n_blocks) + 3
        self.pool = torch.full((num_blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
        order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
        self.tables = [[order.pop() for _ in range(n)] for n in n_blocks]
        for table, n in zip(self.tables, context_lens):
            for p in range(n):
                self.pool[table[p // block_size], :, :, p % block_size] = torch.randn(
                    layers, 2, kv_heads, head_dim, generator=g).to(dtype)
        width = max(n_blocks)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        self.k, self.v = self.pool[:, 1, 0], self.pool[:, 1, 1]  # strided per-layer views, as the engine's

    def clean(self):  # float32 copies with the poison zeroed, for the references
        return self.k.float().nan_to_num(0.0), self.v.float().nan_to_num(0.0)


def _queries(g, n, num_heads, kv_heads, head_dim, dtype):
    """q as the engine hands it over: a strided view into the rotated q|k heads."""
    qk = torch.randn(n, num_heads + kv_heads, head_dim, generator=g).to(dtype)
    return qk[:, :num_heads]


@pytest.mark.parametrize("dtype,block_size,group,num_splits", [
    (torch.float32, 8, 1, 1),
    (torch.float16, 16, 4, 3),
    (torch.bfloat16, 32, 8, 2),
    (torch.float32, 16, 3, None),  # the split count the wrapper picks
    (torch.float16, 8, 8, 5),
])
def test_decode_attention_matches_reference(dtype, block_size, group, num_splits):
    g = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads, head_dim = 2, 32
    lens = [1, 19, 150, block_size, 67]  # one token, odd, several tiles/splits, one full block
    pool = PagedPool(g, lens, block_size, kv_heads, head_dim, dtype)
    q = _queries(g, len(lens), kv_heads * group, kv_heads, head_dim, dtype)
    context_lens = torch.tensor(lens)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    tri.paged_decode_attention(q, pool.k, pool.v, pool.block_tables, context_lens, head_dim**-0.5,
                               out=out, num_splits=num_splits)
    k, v = pool.clean()
    expect = ref.paged_decode_attention(q.float(), k, v, pool.block_tables, context_lens, head_dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect, **TOL[dtype])


@pytest.mark.parametrize("dtype,block_size,group", [
    (torch.float32, 8, 1),
    (torch.float16, 16, 4),
    (torch.bfloat16, 32, 8),
    (torch.float32, 16, 3),
])
def test_prefill_attention_matches_reference(dtype, block_size, group):
    g = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads, head_dim = 2, 48  # head_dim not a power of two
    # (context, chunk): no cached prefix, a prefix and an odd chunk, one token, a long chunk.
    seqs = [(21, 21), (45, 7), (30, 1), (90, 70)]
    pool = PagedPool(g, [c for c, _ in seqs], block_size, kv_heads, head_dim, dtype)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))])
    q = _queries(g, int(cu[-1]), kv_heads * group, kv_heads, head_dim, dtype)
    context_lens = torch.tensor([c for c, _ in seqs])
    max_new = max(n for _, n in seqs)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    tri.paged_prefill_attention(q, pool.k, pool.v, cu, context_lens, pool.block_tables, max_new,
                                head_dim**-0.5, out=out)
    k, v = pool.clean()
    expect = ref.paged_prefill_attention(q.float(), k, v, cu, context_lens, pool.block_tables, max_new,
                                         head_dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect, **TOL[dtype])


def test_batched_attention_references_match_the_grouped_cpu_ops():
    """The whole-batch references are thin wrappers: check them against naive attention."""
    g = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim, bs = 2, 3, 16, 8
    lens = [5, 17, 9]
    pool = PagedPool(g, lens, bs, kv_heads, head_dim, torch.float64)
    k, v = pool.k.nan_to_num(0.0), pool.v.nan_to_num(0.0)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g, dtype=torch.float64)
    got = ref.paged_decode_attention(q, k, v, pool.block_tables, torch.tensor(lens), 0.3)
    for i, (n, table) in enumerate(zip(lens, pool.tables)):
        kc = k[table].flatten(0, 1)[:n].repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        vc = v[table].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        p = torch.einsum("hd,nhd->hn", q[i], kc).mul(0.3).softmax(-1)
        torch.testing.assert_close(got[i], torch.einsum("hn,nhd->hd", p, vc))
    chunks = [2, 17, 9]
    cu = torch.tensor([0, 2, 19, 28])
    qs = torch.randn(28, kv_heads * group, head_dim, generator=g, dtype=torch.float64)
    got = ref.paged_prefill_attention(qs, k, v, cu, torch.tensor(lens), pool.block_tables, 17, 0.3)
    for i, (n, c, table) in enumerate(zip(lens, chunks, pool.tables)):
        kc = k[table].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        vc = v[table].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,nhd->hqn", qs[cu[i]:cu[i + 1]], kc) * 0.3
        causal = torch.arange(n)[None, :] <= torch.arange(n - c, n)[:, None]
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[cu[i]:cu[i + 1]], torch.einsum("hqn,nhd->qhd", p, vc))


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 8), (torch.float16, 16), (torch.bfloat16, 32)])
def test_write_kv_writes_exactly_the_new_slots(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    kv_heads, head_dim, num_blocks, n = 3, 24, 9, 37
    pool = torch.full((num_blocks, 2, 2, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    blocks, offsets = slots // block_size, slots % block_size
    kv = torch.randn(n, 2 * kv_heads + 1, head_dim, generator=g).to(dtype)  # strided views, as in the model
    k, v = kv[:, :kv_heads], kv[:, kv_heads:2 * kv_heads]
    expect = pool.clone()
    ref.write_kv(expect[:, 1, 0], expect[:, 1, 1], blocks, offsets, k, v)
    tri.write_kv(pool[:, 1, 0], pool[:, 1, 1], blocks, offsets, k, v)
    assert torch.equal(pool.nan_to_num(7.0), expect.nan_to_num(7.0))  # same values, same NaNs elsewhere
    assert not pool[blocks, 1, :, offsets].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_and_unpack_blocks_round_trip(dtype):
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(12, 3, 2, 16, 2, 40, generator=g).to(dtype)  # 7,680 values a block
    ids = torch.tensor([9, 2, 11, 5, 0])
    staging = torch.full((5, *pool.shape[1:]), float("nan"), dtype=dtype)
    tri.pack_blocks(pool, ids, out=staging)
    assert torch.equal(staging, ref.pack_blocks(pool, ids))
    new = torch.randn(staging.shape, generator=g).to(dtype)
    got, expect = pool.clone(), pool.clone()
    got[ids] = float("nan")  # poison the destination blocks
    tri.unpack_blocks(got, ids, new)
    ref.unpack_blocks(expect, ids, new)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_fused_residual_add_match_reference(dtype):
    g = torch.Generator().manual_seed(1)
    rows, hidden, eps = 37, 200, 1e-5
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    tri.add_rms_norm(x, residual, weight, eps, out=out, residual_out=res_out)
    expect, expect_res = ref.add_rms_norm(x, residual, weight, eps)
    assert torch.equal(res_out, expect_res)  # the residual stream is bit-exact
    plain = torch.full_like(x, float("nan"))
    tri.rms_norm(x, weight, eps, out=plain)
    # 16-bit: the reference's rounding points, so at most one ulp apart (from the order of the
    # sum of squares); float32 rounds only at the end: a few ulps.
    ulps = 4 if dtype == torch.float32 else 1
    for got, expect in ((out, expect), (plain, ref.rms_norm(x, weight, eps))):
        bound = ulps * torch.finfo(dtype).eps * expect.float().abs() + torch.finfo(dtype).tiny
        assert ((got.float() - expect.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_is_bit_exact_with_reference(dtype):
    g = torch.Generator().manual_seed(2)
    n, heads, head_dim = 13, 7, 48  # 24 rotated pairs per head: not a power of two
    qkv = torch.randn(n, heads + 2, head_dim, generator=g).to(dtype)
    x = qkv[:, :heads]  # strided, as the model's q|k view of the fused projection
    angles = torch.randint(0, 4096, (n, 1), generator=g).float() * torch.rand(head_dim // 2, generator=g)
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [n, 1, head_dim], like RotaryEmbedding
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = torch.full((n, heads, head_dim), float("nan"), dtype=dtype)
    tri.rotary(x, cos, sin, out=out)
    assert torch.equal(out, ref.rotary(x, cos, sin))


def _sampling_batch(g, rows, vocab, scale):
    logits = torch.randn(rows, vocab, generator=g) * scale
    temperature = 0.3 + torch.rand(rows, generator=g)
    top_k = torch.randint(1, vocab // 4, (rows,), generator=g)
    top_k[::4] = 0  # off
    top_p = 0.05 + 0.9 * torch.rand(rows, generator=g)
    top_p[1::3] = 1.0  # off
    min_p = 0.2 * torch.rand(rows, generator=g)
    min_p[::5] = 0.0  # off
    return logits, temperature, top_k, top_p, min_p


def _top_p_margin(logits, temperature, top_k, top_p):
    """Smallest |mass before a token - top_p| over rows using top-p: the kept sets are compared
    exactly, so the data must not put a token's cumulative mass within float error of top_p."""
    scaled = logits / temperature[:, None]
    kept = ref.sampling_mask(logits, temperature, top_k, torch.ones_like(top_p), torch.zeros_like(top_p))
    probs = scaled.masked_fill(~kept, float("-inf")).sort(dim=-1, descending=True).values.softmax(-1)
    before = probs.cumsum(-1) - probs
    rows = top_p < 1
    return (before[rows] - top_p[rows, None]).abs().min().item()


@pytest.mark.parametrize("vocab,scale", [(1000, 3.0), (777, 0.4)])  # peaked / flat (top-p keeps hundreds)
def test_sampling_keeps_exactly_the_reference_support(vocab, scale):
    g = torch.Generator().manual_seed(vocab)
    batch = _sampling_batch(g, 48, vocab, scale)
    assert _top_p_margin(*batch[:4]) > 1e-5, "test data too close to a top-p boundary; change the seed"
    got = tri.sampling_mask(*batch)
    expect = ref.sampling_mask(*batch)
    assert torch.equal(got, expect), f"{(got != expect).sum()} tokens differ"
    assert expect.sum(-1).min() >= 1 and (expect.sum(-1) < vocab).any() and (expect.sum(-1) > 50).any()


def _top_p_split_at_ties(logits, temperature, top_k, top_p):
    """Top-p as a sort leaves it when equal logits straddle the cut: only those the sort
    put before it stay (the rule the reference no longer follows)."""
    scaled = logits / temperature[:, None]
    kept = ref.sampling_mask(logits, temperature, top_k, torch.ones_like(top_p), torch.zeros_like(top_p))
    sorted_logits, order = scaled.masked_fill(~kept, float("-inf")).sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(-1)
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1)
    return kept & ~torch.empty_like(drop).scatter_(1, order, drop)


def test_sampling_keeps_whole_ties_at_the_cuts_like_the_reference():
    """Logits rounded to bfloat16, as a model's are: many equal logits, some of them across a
    top-k or top-p cut. Each stage keeps the whole tie, in the kernel and the reference."""
    g = torch.Generator().manual_seed(21)
    logits, temperature, top_k, top_p, min_p = _sampling_batch(g, 48, 1000, 4.0)
    logits = logits.bfloat16().float()
    temperature = torch.ones_like(temperature)
    got = tri.sampling_mask(logits, temperature, top_k, top_p, min_p)
    expect = ref.sampling_mask(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(got, expect), f"{(got != expect).sum()} tokens differ"
    no_min_p = torch.zeros_like(min_p)
    split = _top_p_split_at_ties(logits, temperature, top_k, top_p)
    whole = ref.sampling_mask(logits, temperature, top_k, top_p, no_min_p)
    assert (split != whole).any(), "no tie across a top-p cut in the data: the test checks nothing; change the seed"


def test_seeded_sampling_draws_the_reference_tokens():
    """Seeded rows hash (seed, position, token) exactly like engine.seeded_random: same tokens."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 200, 333
    batch = _sampling_batch(g, rows, vocab, 1.0)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 5000, (rows,), generator=g)
    out = torch.full((rows,), -1, dtype=torch.int64)
    tri.sample(*batch, seeds, positions, out=out)
    expect = ref.sample(*batch, seeded_exponentials(seeds, positions, vocab))
    assert torch.equal(out, expect)


def test_sampling_distribution_matches_reference():
    """4,096 draws per row from two fixed rows (one truncated every way, one by temperature
    only): every draw is in the support, and each token's count is within 6 sigma of the
    reference probability (a false failure has odds below 1e-7)."""
    g = torch.Generator().manual_seed(11)
    vocab, draws = 50, 4096
    base = torch.randn(2, vocab, generator=g) * 1.5
    logits = base.repeat_interleave(draws, dim=0)
    temperature = torch.tensor([0.8, 1.3]).repeat_interleave(draws)
    top_k = torch.tensor([20, 0]).repeat_interleave(draws)
    top_p = torch.tensor([0.85, 1.0]).repeat_interleave(draws)
    min_p = torch.tensor([0.03, 0.0]).repeat_interleave(draws)
    seeds = torch.arange(2 * draws) * 7919 + 12345
    tokens = tri.sample(logits, temperature, top_k, top_p, min_p, seeds, torch.zeros_like(seeds))
    for row in range(2):
        sl = slice(row * draws, (row + 1) * draws)
        keep = ref.sampling_mask(logits[sl][:1], temperature[sl][:1], top_k[sl][:1], top_p[sl][:1], min_p[sl][:1])[0]
        probs = (logits[sl][0] / temperature[sl][0]).masked_fill(~keep, float("-inf")).softmax(-1).double()
        counts = torch.bincount(tokens[sl], minlength=vocab).double()
        assert counts[~keep].sum() == 0, "drew a token outside the support"
        sigma = (draws * probs * (1 - probs)).sqrt()
        assert ((counts - draws * probs).abs() <= 6 * sigma + 1).all(), (counts, draws * probs)
        assert (counts > 0).sum() > 3  # the draws spread over several tokens
        if row == 0:
            assert 3 < keep.sum() < vocab  # the first row really is truncated
