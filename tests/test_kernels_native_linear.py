"""The native small-batch bf16 matmuls (kernels/csrc/amx_bf16.cpp on AMX tiles,
gemv_bf16.cpp on AVX512-BF16 dots) against F.linear in float32 on random inputs: each
kernel the host can run, directly, over row counts that fill one tile, part of one, and
several row groups, with and without a bias, x with a row stride; then through
kernels.linear as the model calls it, across the row count where it hands over to oneDNN.
A kernel whose ISA this CPU lacks must refuse (and linear still answer)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as klinear
from kernels import native
from kernels.host import cpu


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.fail("no g++ on this host: the native kernels cannot be tested (install g++)")
    return native.open_library(native.build(tmp_path_factory.mktemp("native")))


KERNELS = {"amx": cpu().amx_bf16, "dots": cpu().avx512_bf16}  # kernel -> whether this CPU runs it


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 70])
@pytest.mark.parametrize("k", [96, 98])
def test_each_kernel_matches_f_linear(library, kernel, rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    n = 176  # 11 blocks of 16 output rows: an odd count, so the AMX kernel's last step has one
    w = (0.1 * torch.randn(n, k, generator=gen)).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k + 30, generator=gen).bfloat16()[:, 7:7 + k]  # rows strided
    got = native.gemv_bf16(library, x, native.pack_gemv_weight(w), b, amx=kernel == "amx")
    if not KERNELS[kernel] or (kernel == "amx" and k % 32):  # AMX steps K by 32
        assert got is None
        return
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40, 128, 129])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_f_linear(library, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    n, k = 176, 96
    w = (0.1 * torch.randn(n, k, generator=gen)).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    wide = torch.randn(rows, k + 30, generator=gen).bfloat16()
    x = wide[:, 5:5 + k]  # rows strided, as a view of a wider activation
    packed = klinear.pack_weight(w, library)
    assert (packed.gemv is not None) == (cpu().avx512_bf16 or cpu().amx_bf16)
    assert packed.amx == cpu().amx_bf16
    got = klinear.linear(x, w, b, packed)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_the_kernel_refuses_what_it_cannot_take(library):
    x = torch.randn(2, 64).bfloat16()
    assert native.pack_gemv_weight(torch.randn(40, 64).bfloat16()) is None  # 40 rows: not 16k
    assert native.pack_gemv_weight(torch.randn(32, 63).bfloat16()) is None  # odd k
    assert native.pack_gemv_weight(torch.randn(32, 64)) is None  # float32
    packed = native.pack_gemv_weight(torch.randn(32, 64).bfloat16())
    assert native.gemv_bf16(library, x.float(), packed, None) is None  # float32 x
    with pytest.raises(ValueError, match="columns"):
        native.gemv_bf16(library, torch.randn(2, 62).bfloat16(), packed, None)
    if not cpu().avx512_bf16:
        assert native.gemv_bf16(library, x, packed, None) is None  # no AVX512-BF16: refused at run time
