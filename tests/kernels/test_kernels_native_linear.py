"""The native small-batch matmuls (kernels/csrc/amx_bf16.cpp on AMX tiles, gemv_bf16.cpp on
AVX512-BF16 dots, gemm_f32.cpp on FMA tiles in float32 and in bf16 widened) against F.linear in float64 on random
inputs: each kernel the host can run, directly, over row counts that fill one tile, part
of one, and several, output widths of whole and partial register tiles, with a bias, x
with a row stride; then through kernels.linear as the model calls it, across the row
count where it hands over to oneDNN / F.linear. A kernel whose ISA this CPU lacks must
refuse (and linear still answer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as klinear
from kernels import native
from kernels.host import cpu


@pytest.fixture(scope="module")
def library(libraries):
    return libraries[native.runnable_levels()[-1]]  # the host's own level, as the engine loads


# kernel -> whether this CPU runs it
KERNELS = {"amx": cpu().amx_bf16, "dots": cpu().avx512_bf16, "f32": native.isa_level() != "generic",
           "fma_bf16": native.isa_level() != "generic"}
TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3, 6, 12, 16, 17, 24, 33, 70])
@pytest.mark.parametrize("n,k", [(176, 96), (176, 98), (48, 64)])
def test_each_kernel_matches_f_linear(library, kernel, rows, n, k):
    """n = 176: 11 blocks of 16 output rows (the AMX kernel's last step has one block, the
    float32 one's last register tile 3 of 4 on AVX-512); n = 48: less than one tile."""
    dtype = native.MATMULS[kernel][1]
    gen = torch.Generator().manual_seed(rows + k + n)
    w = (0.1 * torch.randn(n, k, generator=gen)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k + 30, generator=gen).to(dtype)[:, 7:7 + k]  # rows strided
    got = native.matmul(library, x, native.pack_matmul_weight(w, kernel), b, kernel)
    if not KERNELS[kernel] or (kernel == "amx" and k % 32):  # AMX steps K by 32
        assert got is None
        return
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("level", native.runnable_levels())
@pytest.mark.parametrize("kernel", ["f32", "fma_bf16"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_the_fma_kernels_match_f_linear_at_every_isa_level(libraries, level, kernel, rows):
    """The FMA tiles are built per ISA level (AVX-512: 16 lanes, AVX2: 8, two vectors a
    block); every level this host runs, not only its own; the generic build refuses."""
    dtype = native.MATMULS[kernel][1]
    gen = torch.Generator().manual_seed(rows)
    w = (0.1 * torch.randn(208, 98, generator=gen)).to(dtype)  # 13 blocks: whole and partial tiles
    b = torch.randn(208, generator=gen).to(dtype)
    x = torch.randn(rows, 98, generator=gen).to(dtype)
    got = native.matmul(libraries[level], x, native.pack_matmul_weight(w, kernel), b, kernel)
    if level == "generic":
        assert got is None
        return
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), b.double()), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 128, 129, 257, 513])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_f_linear(library, dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    n, k = 176, 96
    w = (0.1 * torch.randn(n, k, generator=gen)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    wide = torch.randn(rows, k + 30, generator=gen).to(dtype)
    x = wide[:, 5:5 + k]  # rows strided, as a view of a wider activation
    packed = klinear.pack_weight(w, library)
    kernel, _ = klinear.native_kernel(dtype)
    if kernel is not None:  # this CPU runs a native kernel for the dtype: the weight is packed for it
        assert packed is not None and packed.kernel == kernel
    got = klinear.linear(x, w, b, packed)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    if packed is not None and packed.serves_every_x:  # as the model runs it: the weight released
        torch.testing.assert_close(klinear.linear(x, None, b, packed), got, atol=0, rtol=0)


def test_a_model_keeps_one_copy_of_its_weights(library):
    """After packing, a layer whose packed copies serve every row count holds no unpacked
    weight; where nothing was packed it keeps it (and still answers)."""
    from engine.model import Linear

    for dtype in (torch.float32, torch.bfloat16):
        layer = Linear(96, 176, bias=False).requires_grad_(False)
        layer.weight.copy_(torch.randn(176, 96))  # the engine's Linear draws no weights: a checkpoint's come
        layer = layer.to(dtype)
        w = layer.weight.detach().clone()
        layer.pack(library)
        x = torch.randn(600, 96).to(dtype)  # more rows than any kernel takes at once
        assert (layer.weight is None) == (layer.packed is not None and layer.packed.serves_every_x)
        torch.testing.assert_close(layer(x).double(), F.linear(x.double(), w.double()), **TOLERANCE[dtype])


def test_the_kernels_refuse_what_they_cannot_take(library):
    x = torch.randn(2, 64).bfloat16()
    assert native.pack_matmul_weight(torch.randn(40, 64).bfloat16(), "amx") is None  # 40 rows: not 16k
    assert native.pack_matmul_weight(torch.randn(40, 64), "f32") is None
    assert native.pack_matmul_weight(torch.randn(32, 63).bfloat16(), "dots") is None  # odd k
    assert native.pack_matmul_weight(torch.randn(32, 64), "dots") is None  # float32 for a bf16 kernel
    packed = native.pack_matmul_weight(torch.randn(32, 64).bfloat16(), "dots")
    assert native.matmul(library, x.float(), packed, None, "dots") is None  # float32 x
    with pytest.raises(ValueError, match="columns"):
        native.matmul(library, torch.randn(2, 62).bfloat16(), packed, None, "dots")
    for kernel, runs in KERNELS.items():
        if not runs:  # this CPU lacks the kernel's ISA: refused at run time
            dtype = native.MATMULS[kernel][1]
            p = native.pack_matmul_weight(torch.randn(32, 64).to(dtype), kernel)
            assert native.matmul(library, x.to(dtype), p, None, kernel) is None
