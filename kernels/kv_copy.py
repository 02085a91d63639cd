"""Triton copies into and out of the paged KV pool: the per-step cache write, and the
pack / unpack of a request's blocks (all layers) to and from a contiguous staging buffer.

Pure data movement: values are loaded and stored in their own dtype (no arithmetic, so
bf16 is exact in the interpreter too). References: `kernels.reference.write_kv`,
`pack_blocks`, `unpack_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import next_pow2

_PACK_CHUNK = 8192  # elements per program: 16 KiB of bf16, enough in flight per SM to stream


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr, num_tokens,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr,
):
    """BLOCK_T tokens per program; a token's row is its kv_heads * head_dim values."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_ROW)
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    mask = (t < num_tokens)[:, None] & (i < ROW)[None, :]
    block = tl.load(blocks_ptr + t, mask=t < num_tokens, other=0).to(tl.int64)
    slot = tl.load(offsets_ptr + t, mask=t < num_tokens, other=0).to(tl.int64)
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * k_stride_t + head[None, :] * k_stride_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * v_stride_t + head[None, :] * v_stride_h + d[None, :], mask=mask)
    kc = k_cache_ptr + (block * kc_stride_b + slot * kc_stride_s)[:, None] + head[None, :] * kc_stride_h + d[None, :]
    vc = v_cache_ptr + (block * vc_stride_b + slot * vc_stride_s)[:, None] + head[None, :] * vc_stride_h + d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,  # [num_tokens] block id of each new token
    slot_offsets: torch.Tensor,  # [num_tokens] offset inside that block
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous (stride {t.stride(-1)})")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"write_kv copies without casting: k {k.dtype}, cache {k_cache.dtype}")
    row = kv_heads * head_dim
    block_row = next_pow2(row)
    block_t = min(next_pow2(num_tokens), max(1, 4096 // block_row))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row, num_warps=4,
    )


@triton.jit
def _block_copy_kernel(src_ptr, dst_ptr, ids_ptr, block_elems, PACK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (i, c) copies chunk c of pool block ids[i] to / from staging row i."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    e = c * CHUNK + tl.arange(0, CHUNK)
    mask = e < block_elems
    if PACK:  # pool -> staging
        src = src_ptr + block * block_elems + e
        dst = dst_ptr + i * block_elems + e
    else:  # staging -> pool
        src = src_ptr + i * block_elems + e
        dst = dst_ptr + block * block_elems + e
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _block_copy(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, pack: bool) -> None:
    if not pool.is_contiguous() or not staging.is_contiguous():
        raise ValueError("pack/unpack need the contiguous block-major pool and a contiguous staging buffer")
    if staging.dtype != pool.dtype or staging.shape[1:] != pool.shape[1:] or staging.shape[0] != block_ids.shape[0]:
        raise ValueError(f"staging {tuple(staging.shape)} {staging.dtype} does not hold {block_ids.shape[0]} "
                         f"blocks of pool {tuple(pool.shape)} {pool.dtype}")
    n = block_ids.shape[0]
    block_elems = pool[0].numel()
    if n == 0:
        return
    chunk = min(_PACK_CHUNK, next_pow2(block_elems))
    src, dst = (pool, staging) if pack else (staging, pool)
    _block_copy_kernel[(n, triton.cdiv(block_elems, chunk))](src, dst, block_ids, block_elems, PACK=pack,
                                                             CHUNK=chunk, num_warps=8)


def pack_blocks(
    pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    out: torch.Tensor | None = None,  # [n, num_layers, 2, block_size, kv_heads, head_dim]
) -> torch.Tensor:
    if out is None:
        out = torch.empty((block_ids.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _block_copy(pool, block_ids, out, pack=True)
    return out


def unpack_blocks(
    pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64, distinct
    staging: torch.Tensor,  # [n, num_layers, 2, block_size, kv_heads, head_dim]
) -> None:
    _block_copy(pool, block_ids, staging, pack=False)
