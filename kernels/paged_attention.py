"""Triton paged attention: decode (flash-decoding, split along the context) and varlen prefill.

Both read K/V straight from the paged pool through per-sequence block tables; a token at
position p of a sequence lives in slot `p % block_size` of block `table[p // block_size]`.
The pool views are strided (engine/kv_cache.py: [num_blocks, block_size, kv_heads,
head_dim] slices of a block-major tensor), so every stride is passed in; only head_dim must
be contiguous. Grouped-query attention packs the `G` query heads of one KV head into the
rows of one tile, so each K/V tile is loaded once for all of them.

Softmax runs online in base 2 (scores pre-multiplied by scale * log2(e)), accumulating in
fp32. References: `kernels.reference.paged_decode_attention` / `paged_prefill_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_util import INTERPRET, cast_to, dot_operand, next_pow2

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # keys per tile
_MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more in partials than it gains


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, tokens_per_split,
    q_stride_t, q_stride_h,
    k_stride_b, k_stride_s, k_stride_h,
    v_stride_b, v_stride_s, v_stride_h,
    tables_stride, out_stride_t, out_stride_h,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: one sequence, one KV head (its G query heads as rows), one context split."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    if start >= ctx:  # the split lies past this sequence's context; the reduce skips it
        return
    end = tl.minimum(start + tokens_per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + g
    g_ok = g < G
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = dot_operand(q)  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * tables_stride
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_row = block * k_stride_b + slot * k_stride_s + kv_head * k_stride_h  # [BLOCK_N]
        kt = tl.load(k_ptr + k_row[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, dot_operand(kt), input_precision="ieee") * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile's first key is always valid
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v_row = block * v_stride_b + slot * v_stride_s + kv_head * v_stride_h
        v = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        v = dot_operand(v)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    o = acc / l[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
        tl.store(dst, cast_to(o, out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=g_ok[:, None])
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, tokens_per_split, out_stride_t, out_stride_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine one (sequence, head)'s split partials by their log-sum-exp weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    num_valid = tl.cdiv(ctx, tokens_per_split)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = sp < num_valid
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S], 0 on splits past the context
    o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + d, cast_to(res, out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, cu_ptr, lens_ptr, out_ptr, scale_log2,
    q_stride_t, q_stride_h,
    k_stride_b, k_stride_s, k_stride_h,
    v_stride_b, v_stride_s, v_stride_h,
    tables_stride, out_stride_t, out_stride_h,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: TOKENS query tokens of one sequence x the G query heads of one KV head
    (row r is token r // G, head r % G), causal over the sequence's whole context."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq).to(tl.int32)
    num_new = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_start
    first = tile * TOKENS
    if first >= num_new:  # grids are sized for the longest chunk
        return
    ctx = tl.load(lens_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = first + r // G
    heads = kv_head * G + r % G
    row_ok = (r < TOKENS * G) & (tok < num_new)
    tok = tl.minimum(tok, num_new - 1)  # padding rows repeat the last token: no NaN, not stored
    q_pos = ctx - num_new + tok  # [BLOCK_M] position of each row's query in its sequence
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = dot_operand(q)  # [BLOCK_M, BLOCK_D]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * tables_stride
    kv_end = ctx - num_new + tl.minimum(first + TOKENS, num_new)  # past the tile's last query
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_row = block * k_stride_b + slot * k_stride_s + kv_head * k_stride_h
        kt = tl.load(k_ptr + k_row[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, dot_operand(kt), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: key 0 is visible to every query
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v_row = block * v_stride_b + slot * v_stride_s + kv_head * v_stride_h
        v = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        v = dot_operand(v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    o = acc / l[:, None]
    dst = out_ptr + (q_start + tok)[:, None] * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
    tl.store(dst, cast_to(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def decode_splits(num_programs: int, width: int, device: torch.device) -> int:
    """Context splits so that (sequences x KV heads x splits) fills the GPU about twice over,
    never cutting a context into pieces shorter than _MIN_TOKENS_PER_SPLIT."""
    want = math.ceil(2 * _num_sms(device) / max(num_programs, 1))
    return max(1, min(want, math.ceil(width / _MIN_TOKENS_PER_SPLIT), 64))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous (stride {t.stride(-1)})")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks], padded with any valid block id
    context_lens: torch.Tensor,  # [num_seqs] >= 1, <= max_blocks * block_size
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,  # None: chosen from the GPU's size
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _check(q, k_cache, v_cache, out)
    if n == 0:
        return out
    group = num_heads // kv_heads
    width = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = decode_splits(n * kv_heads, width, q.device)
    tokens_per_split = triton.cdiv(triton.cdiv(width, num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = triton.cdiv(width, tokens_per_split)
    block_d = max(16, next_pow2(head_dim))
    part_out = part_lse = out  # unused placeholders when there is one split
    if num_splits > 1:
        part_out = torch.empty((n, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(n, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * _LOG2E, tokens_per_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, G=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=_BLOCK_N,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(n, num_heads)](
            part_out, part_lse, context_lens, out, tokens_per_split, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=4,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: every chunk's queries, back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], chunks already written
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]: chunk i is q[cu[i]:cu[i + 1]]
    context_lens: torch.Tensor,  # [num_seqs]: cached prefix + chunk; queries are the last positions
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    max_seqlen_q: int,  # longest chunk (sizes the grid; no device sync)
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _check(q, k_cache, v_cache, out)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // kv_heads
    block_d = max(16, next_pow2(head_dim))
    # 128 x 64 tiles feed the tensor cores best; fp32 (IEEE dots on the FMA units) and wide
    # heads take smaller tiles, which keep every tile in registers (no spills at head_dim 128).
    # The interpreter takes the big tiles whatever the dtype: it pays per program, not per row.
    big = INTERPRET or (q.dtype != torch.float32 and block_d <= 128)
    block_m = max(128 if big else 64, next_pow2(group))
    block_n = _BLOCK_N if big else 32
    tokens = block_m // group
    grid = (triton.cdiv(max_seqlen_q, tokens), num_seqs, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TOKENS=tokens,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=8,
    )
    return out
