"""The CPU ops behind kernels/ against plain per-sequence attention and F.linear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import linear as klinear
from kernels.attention_step import build_decode_mask

H, KVH, D, BS = 6, 2, 16, 4


def naive_attention(q, k, v, scale):  # q [n, H, D], k/v [ctx, KVH, D]; causal, q = last n positions
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hnc,chd->nhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("seed", range(3))
def test_decode_attention_matches_naive(seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g, dtype=torch.float64)
    lens = [1, 7, 13, 4]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(math.ceil(n / BS))] for n in lens]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), H, D, generator=g, dtype=torch.float64)
    mask = build_decode_mask(torch.tensor(lens), width * BS)
    ops = kernels.get_ops("cpu")
    out = ops.decode_attention(q, k_cache, v_cache, padded, mask, D**-0.5)
    for i, (n, t) in enumerate(zip(lens, tables)):
        k = k_cache[t].flatten(0, 1)[:n]
        v = v_cache[t].flatten(0, 1)[:n]
        torch.testing.assert_close(out[i:i + 1], naive_attention(q[i:i + 1], k, v, D**-0.5))


@pytest.mark.parametrize("num_new,ctx", [(5, 5), (3, 11), (8, 9)])
def test_prefill_attention_with_and_without_cached_prefix(num_new, ctx):
    g = torch.Generator().manual_seed(ctx)
    q = torch.randn(num_new, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
    v = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
    out = kernels.get_ops("cpu").prefill_attention(q, k, v, D**-0.5)
    torch.testing.assert_close(out, naive_attention(q, k, v, D**-0.5))


def test_write_kv_lands_in_the_right_slots():
    k_cache = torch.zeros(8, BS, KVH, D)
    v_cache = torch.zeros(8, BS, KVH, D)
    blocks, offsets = torch.tensor([5, 5, 2]), torch.tensor([3, 0, 1])
    k, v = torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    kernels.get_ops("cpu").write_kv(k_cache, v_cache, blocks, offsets, k, v)
    for i in range(3):
        assert torch.equal(k_cache[blocks[i], offsets[i]], k[i])
        assert torch.equal(v_cache[blocks[i], offsets[i]], v[i])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


@pytest.mark.parametrize("m", [1, 7, 64])
def test_packed_bf16_linear_matches_f_linear(m):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(m, 64, generator=g).bfloat16()
    packed = klinear.pack_weight(w)
    supported, why = klinear.packing_supported()
    # the path this host takes: packed where oneDNN's bf16 runs (AVX-512), F.linear elsewhere
    assert (packed is not None) == supported, why
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(klinear.linear(x, w, b, packed).float(), ref, atol=2e-2, rtol=2e-2)
    assert klinear.pack_weight(w.float()) is None  # fp32 keeps F.linear


def test_group_by_length_covers_every_decode_once_and_splits_outliers():
    from kernels.attention_step import group_by_length

    assert group_by_length([]) == []
    assert group_by_length([5, 5, 6]) == [(0, 3)]
    lengths = [16] * 20 + [2000]
    groups = group_by_length(lengths, overhead=256)
    assert groups == [(0, 20), (20, 21)]  # one long context must not pad twenty short ones
    lengths = sorted([3, 900, 40, 41, 1200, 7, 500, 520, 16])
    groups = group_by_length(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
