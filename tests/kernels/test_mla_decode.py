"""The Triton MLA decode kernel (kernels/mla_decode.py) against its torch reference
(kernels.latent_attention.paged_latent_decode), in Triton's interpreter on CPU. Slots no
context covers and the padded tables' block are NaN, so a kernel that reads past a context
or through padding gives NaN; the output is NaN-poisoned and must come back fully written."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and so triton) are first imported

import pytest
import torch

from kernels.latent_attention import paged_latent_decode
from kernels.mla_decode import mla_decode

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype,heads,latent,rope,block_size", [
    (torch.float32, 4, 32, 16, 16),  # fewer heads than a program's tile
    (torch.bfloat16, 20, 32, 16, 8),  # two head tiles
    (torch.float32, 3, 40, 9, 16),  # an odd entry: its last half padded
])
def test_mla_decode_matches_the_reference(dtype, heads, latent, rope, block_size):
    g = torch.Generator().manual_seed(heads)
    entry = latent + rope
    half = -(-entry // 2)
    lens = [1, 17, 70]
    blocks = [-(-n // block_size) for n in lens]
    pool = torch.full((sum(blocks) + 2, 2, 2, block_size, 1, half), float("nan"), dtype=dtype)  # layer 1 read
    tables, next_block = [], 1  # block 0: all NaN, the padding's
    for n, b in zip(lens, blocks):
        table = list(range(next_block, next_block + b))
        next_block += b
        for p in range(n):  # a token's entry, halved over the K and V planes, the padding zero
            e = torch.nn.functional.pad(torch.randn(entry, generator=g), (0, 2 * half - entry)).to(dtype)
            pool[table[p // block_size], 1, 0, p % block_size, 0] = e[:half]
            pool[table[p // block_size], 1, 1, p % block_size, 0] = e[half:]
        tables.append(table + [0] * (max(blocks) - b))
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), heads, entry, generator=g).to(dtype)
    tables, context = torch.tensor(tables), torch.tensor(lens)
    out = torch.full((len(lens), heads, latent), float("nan"), dtype=dtype)
    mla_decode(q, k, v, tables, context, entry ** -0.5, latent, out=out)
    clean_k, clean_v = k.float().nan_to_num(0.0), v.float().nan_to_num(0.0)
    expect = paged_latent_decode(q.float(), clean_k, clean_v, tables, context, entry ** -0.5, latent)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect, **TOL[dtype])


def test_a_latent_narrower_than_half_the_entry_is_refused():
    q = torch.zeros(1, 2, 48)
    cache = torch.zeros(2, 16, 1, 24)
    with pytest.raises(ValueError, match="latent >= half"):
        mla_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0.1, 16)
