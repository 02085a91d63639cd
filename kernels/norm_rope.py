"""Triton RMSNorm (optionally fused with the residual add) and rotary embedding.

Both reproduce the torch reference's rounding, not just its math: values are computed in
fp32 and rounded to the activation dtype exactly where the reference rounds (the residual
sum, the normalised activations before the weight, each product of the rotary), so a bf16
model sees the same numbers to within one ulp of a reduction's order. References:
`kernels.reference.rms_norm`, `add_rms_norm`, `rotary`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import cast_to, next_pow2

_MAX_HIDDEN = 65536  # one row lives in one tile


def _rows_per_program(block: int) -> int:
    """Rows per program: enough for ~4k elements (one row of a 4096-wide model)."""
    return max(1, 4096 // block)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to `dtype` and back to fp32: where a torch op in `dtype` would round."""
    return cast_to(x, dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, num_rows, hidden, eps,
    x_stride, res_stride, out_stride, res_out_stride,
    ADD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = cast_to(x + r, dtype)  # the residual stream, rounded like `residual + x`
        tl.store(res_out_ptr + rows[:, None] * res_out_stride + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, 1) / hidden
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))  # [BLOCK_R]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if dtype == tl.float32:
        y = x * rstd[:, None] * w[None, :]
    else:  # normalise in fp32, round, then scale by the weight in the activation dtype
        y = _round(x * rstd[:, None], dtype) * w[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], cast_to(y, dtype), mask=mask)


def _rms_norm(x, residual, weight, eps, out, residual_out):
    num_rows, hidden = x.shape
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} > {_MAX_HIDDEN}")
    if x.dtype == torch.float64:
        raise ValueError("the Triton RMSNorm computes in float32; use the torch ops for float64")
    for name, t in (("x", x), ("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the hidden dimension must be contiguous")
    if num_rows == 0:
        return
    block_h = next_pow2(hidden)
    block_r = min(next_pow2(num_rows), _rows_per_program(block_h))
    add = residual is not None
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x, residual if add else x, weight, out, residual_out if add else out, num_rows, hidden, eps,
        x.stride(0), residual.stride(0) if add else 0, out.stride(0), residual_out.stride(0) if add else 0,
        ADD=add, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=8 if block_h >= 4096 else 4,
    )


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _rms_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one pass over the rows."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, num_tokens,
    x_stride_t, x_stride_h, cos_stride_t, sin_stride_t, out_stride_t, out_stride_h,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HH: tl.constexpr,
):
    """BLOCK_T tokens x every head's first-half dims (i -> head i // HALF, dim i % HALF)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    i = tl.arange(0, BLOCK_HH)
    h = i // HALF
    d = i % HALF
    mask = (t < num_tokens)[:, None] & (i < HEADS * HALF)[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    x_lo = x_ptr + t[:, None] * x_stride_t + h[None, :] * x_stride_h + d[None, :]
    x1 = tl.load(x_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos_ptr + t[:, None] * cos_stride_t + d[None, :]
    s = sin_ptr + t[:, None] * sin_stride_t + d[None, :]
    c1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded like the torch ops.
    o1 = _round(x1 * c1, dtype) - _round(x2 * s1, dtype)
    o2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
    o_lo = out_ptr + t[:, None] * out_stride_t + h[None, :] * out_stride_h + d[None, :]
    tl.store(o_lo, cast_to(o1, dtype), mask=mask)
    tl.store(o_lo + HALF, cast_to(o2, dtype), mask=mask)


def rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim], x's dtype
    sin: torch.Tensor,
    out: torch.Tensor | None = None,  # [num_tokens, heads, head_dim]
) -> torch.Tensor:
    num_tokens, heads, head_dim = x.shape
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device) if out is None else out
    if head_dim % 2 or x.dtype == torch.float64:
        raise ValueError(f"rotary: head_dim {head_dim} must be even and the dtype at most float32")
    for name, t in (("x", x), ("cos", cos), ("sin", sin), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous")
    if num_tokens == 0:
        return out
    half = head_dim // 2
    block_hh = next_pow2(heads * half)
    block_t = min(next_pow2(num_tokens), _rows_per_program(block_hh))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        x, cos, sin, out, num_tokens,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, HALF=half, BLOCK_T=block_t, BLOCK_HH=block_hh, num_warps=4,
    )
    return out
