"""Triton sampling for a whole batch: temperature, top-k, top-p, min-p and a seeded
exponential race, with no sort of the vocabulary.

Each row's kept set is an upper set of its scaled logits, {i : s_i >= threshold}, so the
first kernel finds that threshold exactly and the second draws from it:

- Floats map to 32-bit keys that sort like the floats. The k-th largest logit is the
  largest key t with count(key >= t) >= k; top-p's cut is the largest key t with
  mass(key >= t) >= top_p * (mass kept by top-k), where mass is exp(s - max). Both are
  found most significant digit first, 4 bits per pass over the row (16 candidate keys
  counted at once): 8 passes each, exact, ties with the cut included.
- min-p keeps s >= max + log(min_p) (log taken by torch, as the reference does).
- The draw is argmax over kept tokens of exp(s - max) / E, E = -log(u) with u from
  murmur3 of (seed, position, token id), bit for bit engine.seeded_random's hash; a row
  with no seed gets a fresh random seed from torch each step.

Reference: `kernels.reference.sampling_mask` (kept set, exactly) and `sample` (same
distribution; the same tokens when given engine.seeded_random's draws).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import INTERPRET, next_pow2


@triton.jit
def _murmur_word(h, k):
    """Mix one 32-bit word k into the murmur3_32 state h (both uint32; products wrap)."""
    k = k * 0xCC9E2D51
    k = (k << 15) | (k >> 17)
    k = k * 0x1B873593
    h = h ^ k
    h = (h << 13) | (h >> 19)
    return h * 5 + 0xE6546B64


@triton.jit
def _fmix32(h):
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _key(s):
    """fp32 -> int64 in [0, 2**32), ordered like the floats (-0.0 counts as +0.0)."""
    b = (s + 0.0).to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.int64) + 2147483647 + 1


@triton.jit
def _unkey(key):
    b = (key - 2147483647 - 1).to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_tile(base, temp, row_ok, v0, vocab, BLOCK_V: tl.constexpr):
    """Columns [v0, v0 + BLOCK_V) of logits / temperature, correctly rounded, and their mask."""
    cols = v0 + tl.arange(0, BLOCK_V)
    ok = row_ok[:, None] & (cols < vocab)[None, :]
    x = tl.load(base + cols[None, :], mask=ok, other=0.0)
    return tl.math.div_rn(x, temp[:, None]), ok, cols


@triton.jit
def _radix_select(base, temp, row_ok, mx, target, vocab,
                  MASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row, the largest key t with F(t) >= target, F(t) = number of tokens with key >= t
    (MASS: their sum of exp(s - mx)). F falls as t grows, so t is built 4 bits at a time."""
    prefix = tl.zeros([BLOCK_R], tl.int64)
    digits = tl.arange(0, 16).to(tl.int64)
    for level in tl.static_range(8):
        cands = prefix[:, None] + (digits << (28 - 4 * level))[None, :]  # [BLOCK_R, 16]
        acc = tl.zeros([BLOCK_R, 16], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            s, ok, _ = _scaled_tile(base, temp, row_ok, v0, vocab, BLOCK_V)
            key = tl.where(ok, _key(s), -1)  # padding counts for no candidate
            if MASS:
                w = tl.where(ok, tl.exp(s - mx[:, None]), 0.0)
            else:
                w = ok.to(tl.float32)
            ge = key[:, :, None] >= cands[:, None, :]  # [BLOCK_R, BLOCK_V, 16]
            acc += tl.sum(tl.where(ge, w[:, :, None], 0.0), 1)
        d = tl.sum((acc >= target[:, None]).to(tl.int64), 1) - 1  # F(cand 0) >= target
        prefix += tl.maximum(d, 0) << (28 - 4 * level)
    return prefix


@triton.jit
def _threshold_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, thr_ptr, max_ptr,
    num_rows, vocab, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """thr[row]: the smallest scaled logit the row keeps; max[row]: its largest."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    base = logits_ptr + rows.to(tl.int64)[:, None] * stride
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    top_k = tl.load(top_k_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
    log_min_p = tl.load(log_min_p_ptr + rows, mask=row_ok, other=float("-inf"))

    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        s, ok, _ = _scaled_tile(base, temp, row_ok, v0, vocab, BLOCK_V)
        mx = tl.maximum(mx, tl.max(tl.where(ok, s, float("-inf")), 1))

    use_k = row_ok & (top_k > 0) & (top_k < vocab)
    use_p = row_ok & (top_p > 0.0) & (top_p < 1.0)
    key_k = tl.zeros([BLOCK_R], tl.int64)  # 0 is below every float's key: keep all
    if tl.max(use_k.to(tl.int32), 0) > 0:
        key_k = _radix_select(base, temp, row_ok, mx, top_k.to(tl.float32), vocab,
                              False, BLOCK_R, BLOCK_V)
        key_k = tl.where(use_k, key_k, 0)
    key_p = tl.zeros([BLOCK_R], tl.int64)
    if tl.max(use_p.to(tl.int32), 0) > 0:
        kept_mass = tl.zeros([BLOCK_R], tl.float32)  # what top-k left: top-p renormalises over it
        for v0 in range(0, vocab, BLOCK_V):
            s, ok, _ = _scaled_tile(base, temp, row_ok, v0, vocab, BLOCK_V)
            keep = ok & (_key(s) >= key_k[:, None])
            kept_mass += tl.sum(tl.where(keep, tl.exp(s - mx[:, None]), 0.0), 1)
        key_p = _radix_select(base, temp, row_ok, mx, top_p * kept_mass, vocab,
                              True, BLOCK_R, BLOCK_V)
        key_p = tl.where(use_p, key_p, 0)
    key = tl.maximum(key_k, key_p)  # top-p's cut is never below top-k's
    thr = tl.where(key > 0, _unkey(key), float("-inf"))
    thr = tl.maximum(thr, mx + log_min_p)
    tl.store(thr_ptr + rows, thr, mask=row_ok)
    tl.store(max_ptr + rows, mx, mask=row_ok)


@triton.jit
def _draw_kernel(
    logits_ptr, stride, temp_ptr, thr_ptr, max_ptr, seeds_ptr, positions_ptr, out_ptr,
    num_rows, vocab, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """out[row] = argmax over kept tokens of exp(s - max) / E(seed, position, token)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    base = logits_ptr + rows.to(tl.int64)[:, None] * stride
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0)
    mx = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    seed = tl.load(seeds_ptr + rows, mask=row_ok, other=0)
    position = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    h = tl.zeros([BLOCK_R], tl.uint32)  # murmur3 seed 0; the request's seed is data
    h = _murmur_word(h, seed.to(tl.uint32))
    h = _murmur_word(h, (seed >> 32).to(tl.uint32))
    h = _murmur_word(h, position.to(tl.uint32))

    best = tl.full([BLOCK_R], -1.0, tl.float32)
    best_i = tl.zeros([BLOCK_R], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        s, ok, cols = _scaled_tile(base, temp, row_ok, v0, vocab, BLOCK_V)
        hv = _fmix32(_murmur_word(h[:, None], cols.to(tl.uint32)[None, :]) ^ 16)  # 16 bytes hashed
        u = ((hv >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 23 bits: u in (0, 1)
        w = tl.where(ok & (s >= thr[:, None]), tl.exp(s - mx[:, None]) / -tl.log(u), -1.0)
        tile_best = tl.max(w, 1)
        tile_i = tl.argmax(w, 1, tie_break_left=True)
        better = tile_best > best  # strict: ties keep the lower token id, like torch.argmax
        best = tl.where(better, tile_best, best)
        best_i = tl.where(better, v0 + tile_i, best_i)
    tl.store(out_ptr + rows, best_i.to(tl.int64), mask=row_ok)


def _blocks(num_rows: int, vocab: int) -> tuple[int, int]:
    """(rows, vocab columns) per tile: 512-wide tiles of one row on a GPU (the 3-D tile of
    16 candidates is 16x that); the same width but many rows per program in the
    interpreter, whose cost is per program and per op, not per element."""
    block_v = min(512, next_pow2(vocab))
    return (min(next_pow2(num_rows), 16384 // block_v) if INTERPRET else 1), block_v


def sampling_threshold(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    temperature: torch.Tensor,  # [num_seqs] float32 > 0
    top_k: torch.Tensor,  # [num_seqs] int64, 0 or >= vocab = off
    top_p: torch.Tensor,  # [num_seqs] float32, 1 = off
    min_p: torch.Tensor,  # [num_seqs] float32, 0 = off
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_seqs] threshold, [num_seqs] max), scaled logits
    num_rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("sampling takes float32 logits with a contiguous vocab dimension")
    thr = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    mx = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return thr, mx
    block_r, block_v = _blocks(num_rows, vocab)
    _threshold_kernel[(triton.cdiv(num_rows, block_r),)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p.log(), thr, mx, num_rows, vocab,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8,
    )
    return thr, mx


def sampling_mask(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:  # [num_seqs, vocab] bool
    """The kept set the draw uses (for tests: it must equal the reference's exactly)."""
    thr, _ = sampling_threshold(logits, temperature, top_k, top_p, min_p)
    return logits / temperature[:, None] >= thr[:, None]


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32, bias and penalties applied
    temperature: torch.Tensor,  # [num_seqs] float32 > 0
    top_k: torch.Tensor,  # [num_seqs] int64
    top_p: torch.Tensor,  # [num_seqs] float32
    min_p: torch.Tensor,  # [num_seqs] float32
    seeds: torch.Tensor,  # [num_seqs] int64 in [0, 2**63)
    positions: torch.Tensor,  # [num_seqs] int64: tokens the request has output so far
    out: torch.Tensor | None = None,  # [num_seqs] int64
) -> torch.Tensor:
    num_rows, vocab = logits.shape
    thr, mx = sampling_threshold(logits, temperature, top_k, top_p, min_p)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device) if out is None else out
    if num_rows == 0:
        return out
    block_r, block_v = _blocks(num_rows, vocab)
    _draw_kernel[(triton.cdiv(num_rows, block_r),)](
        logits, logits.stride(0), temperature, thr, mx, seeds, positions, out, num_rows, vocab,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8,
    )
    return out
