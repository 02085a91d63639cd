"""Triton multi-head latent attention decode (DeepSeek's MLA, absorbed) over the latent pool.

One query token per sequence, every head reading the same per-token entry [latent | rotary
key] (engine/mla.py), kept as the two halves of a one-"head" pool: a layer's `k_cache`
holds entry[:half], `v_cache` entry[half:] (engine/config.py's MLA layout; strided views of
the block-major pool, every stride passed in). One program takes one sequence and a tile of
BLOCK_H heads: each tile of BLOCK_N context tokens is loaded once for all of them (the point
of MLA at decode: one latent stream for every head), scores are q_k . K + q_v . V (the
query's halves against the entry's), softmax runs online in base 2 in fp32, and the values
are the entries' first `latent` values: all of the K half (latent >= half, as in every
DeepSeek shape) and the V half's first latent - half. Reference:
`kernels.latent_attention.paged_latent_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import cast_to, dot_operand, next_pow2

_LOG2E = 1.4426950408889634
_BLOCK_N = 16  # context tokens a tile: the entries are wide (576 in DeepSeek-V3), the tile short
_BLOCK_H = 16  # heads a program (tl.dot needs 16 rows)


@triton.jit
def _mla_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale_log2,
    q_stride_t, q_stride_h, k_stride_b, k_stride_s, v_stride_b, v_stride_s, tables_stride,
    out_stride_t, out_stride_h,
    NUM_HEADS: tl.constexpr, ENTRY: tl.constexpr, HALF: tl.constexpr, LATENT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    q_row = q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h
    qk = dot_operand(tl.load(q_row + d[None, :], mask=h_ok[:, None] & (d[None, :] < HALF), other=0.0))
    qv = dot_operand(tl.load(q_row + HALF + d[None, :], mask=h_ok[:, None] & (d[None, :] < ENTRY - HALF),
                             other=0.0))
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc_k = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # the latent's first HALF values
    acc_v = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # and its rest, LATENT - HALF of them
    table = tables_ptr + seq.to(tl.int64) * tables_stride
    for tile in range(0, ctx, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        ok = pos < ctx
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_rows = block * k_stride_b + slot * k_stride_s
        v_rows = block * v_stride_b + slot * v_stride_s
        kt = dot_operand(tl.load(k_ptr + k_rows[None, :] + d[:, None], mask=ok[None, :] & (d[:, None] < HALF),
                                 other=0.0))  # [BLOCK_D, BLOCK_N]
        vt = dot_operand(tl.load(v_ptr + v_rows[None, :] + d[:, None],
                                 mask=ok[None, :] & (d[:, None] < ENTRY - HALF), other=0.0))
        s = (tl.dot(qk, kt, input_precision="ieee") + tl.dot(qv, vt, input_precision="ieee")) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: a tile's first token is always in the context
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        values_v = tl.where(d[:, None] < LATENT - HALF, vt, tl.zeros_like(vt))  # the V half's latent part only
        acc_k = acc_k * alpha[:, None] + tl.dot(p.to(kt.dtype), tl.trans(kt), input_precision="ieee")
        acc_v = acc_v * alpha[:, None] + tl.dot(p.to(vt.dtype), tl.trans(values_v), input_precision="ieee")
        m = m_new
    out_row = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h
    tl.store(out_row + d[None, :], cast_to(acc_k / l[:, None], out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d[None, :] < HALF))
    tl.store(out_row + HALF + d[None, :], cast_to(acc_v / l[:, None], out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d[None, :] < LATENT - HALF))


def mla_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, entry]: [absorbed query | rotary query]
    k_cache: torch.Tensor,  # [num_blocks, block_size, 1, half]: entry[:half] of each token
    v_cache: torch.Tensor,  # [num_blocks, block_size, 1, half]: entry[half:]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs] >= 1
    scale: float,
    latent: int,  # kv_lora_rank, >= half
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, latent]
) -> torch.Tensor:
    n, num_heads, entry = q.shape
    _, block_size, _, half = k_cache.shape
    if not half <= latent <= entry or 2 * half < entry:
        raise ValueError(f"a latent of {latent} in entries of {entry} kept as halves of {half}: "
                         "the kernel takes latent >= half")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the entry dimension must be contiguous")
    if out is None:
        out = torch.empty((n, num_heads, latent), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _mla_decode_kernel[(n, triton.cdiv(num_heads, _BLOCK_H))](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, ENTRY=entry, HALF=half, LATENT=latent, BLOCK_SIZE=block_size, BLOCK_H=_BLOCK_H,
        BLOCK_D=max(16, next_pow2(half)), BLOCK_N=_BLOCK_N, num_warps=8,
    )
    return out
