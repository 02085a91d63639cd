"""The native row-wise ops (kernels/csrc/norm_act.cpp: RMS norm with and without the
residual add, rotary, SiLU-and-multiply) against the torch reference ops on random inputs,
float32 and bfloat16, at every ISA level this host can run; strided views as the model
passes them (q|k heads out of the fused qkv matmul's rows); and the reference taking over
for shapes the kernels do not serve."""

from __future__ import annotations

import pytest
import torch

from kernels import native, native_ops, reference

LEVELS = native.runnable_levels()


# bf16: the kernels round where the torch ops round; one bf16 step apart at most (the
# norm's rsqrt and SiLU's exp are not torch's to the last bit).
TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
DTYPES = [torch.float32, torch.bfloat16]


def served(level: str) -> bool:
    """Whether the row kernels run at this level (they are vector code only)."""
    return level != "generic"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add_rms_norm_match_the_reference(libraries, level, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(576, generator=gen)).to(dtype)
    plain = native.rms_norm(libraries[level], x, weight, 1e-5)
    fused = native.rms_norm(libraries[level], x, weight, 1e-5, residual=residual)
    if not served(level):
        assert plain is None and fused is None
        return
    torch.testing.assert_close(plain[0], reference.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    want_norm, want_sum = reference.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(fused[1], want_sum, atol=0, rtol=0)  # one rounding, the same one
    torch.testing.assert_close(fused[0], want_norm, **TOLERANCE[dtype])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_reference_on_a_strided_qkv_view(libraries, level, dtype):
    gen = torch.Generator().manual_seed(11)
    tokens, heads, kv_heads, head_dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # rows strided
    angles = torch.rand(tokens, 1, head_dim, generator=gen) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = native.rotary(libraries[level], qk, cos, sin)
    if not served(level):
        assert got is None
        return
    assert got.is_contiguous()
    torch.testing.assert_close(got, reference.rotary(qk, cos, sin), **TOLERANCE[dtype])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_reference_over_a_wide_range(libraries, level, dtype):
    gen = torch.Generator().manual_seed(13)
    x = (8 * torch.randn(33, 2 * 1536, generator=gen)).to(dtype)  # gates far into both tails
    x[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0]).to(dtype)  # past exp's range both ways
    got = native.silu_mul(libraries[level], x)
    if not served(level):
        assert got is None
        return
    torch.testing.assert_close(got, reference.silu_mul(x), **TOLERANCE[dtype])


def test_the_op_set_falls_back_to_the_reference_where_a_kernel_does_not_serve(libraries, monkeypatch):
    """float64, and widths that are not a whole number of vectors: the torch ops answer."""
    monkeypatch.setattr(native_ops, "_lib", libraries[LEVELS[-1]])
    x = torch.randn(3, 20, dtype=torch.float64)
    w = torch.rand(20, dtype=torch.float64)
    torch.testing.assert_close(native_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    odd = torch.randn(3, 20)
    got, total = native_ops.add_rms_norm(odd, odd, w.float(), 1e-6)
    torch.testing.assert_close(got, reference.add_rms_norm(odd, odd, w.float(), 1e-6)[0])
    torch.testing.assert_close(native_ops.silu_mul(torch.randn(2, 10)).shape, torch.Size([2, 5]))
    q = torch.randn(4, 2, 8)
    cs = torch.randn(4, 1, 8)
    torch.testing.assert_close(native_ops.rotary(q, cs, cs), reference.rotary(q, cs, cs))

