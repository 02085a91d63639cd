"""A mixture of experts' experts as two grouped matmuls in Triton (the GPU path of engine/moe.py).

Each token's top-k (expert, weight) pairs are its k *slots* (slot t * k + j). The slots are
sorted by expert and each expert's run padded to a multiple of BLOCK_M with a sentinel
(`align`: torch ops, no host loop over experts), so every block of BLOCK_M sorted slots
belongs to one expert. A launch then computes, for each block and each BLOCK_N columns, the
block's rows times that expert's weight: the first over the tokens' hidden states with the
stacked gate|up weights ([experts, 2 * intermediate, hidden]), the second over the slots'
SiLU(gate) * up with the stacked down weights ([experts, hidden, intermediate]), each row
scaled by its slot's routing weight; the k slots of a token are then summed. An expert's
weights are read once per block of its tokens, and experts no token chose are never read.

`fused_experts` is checked against `reference_experts` (a loop over experts in torch) in
Triton's interpreter; bench/kernels.py --compile-only compiles it for sm_90 and reports spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import silu_mul
from kernels.triton_util import cast_to, dot_operand

BLOCK_M = 16  # slots per block: a decode step's few tokens per expert waste little padding


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots (flat indices of `ids`, [tokens, k]) sorted by expert, each expert's run padded
    to a multiple of `block_m` with the sentinel ids.numel(); and each block's expert."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts, padded_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    expert_of_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - starts[expert_of_sorted]
    sorted_slots = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int64, device=flat.device)
    sorted_slots[padded_starts[expert_of_sorted] + rank] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_slots, block_expert


@triton.jit
def _grouped_matmul(
    a_ptr, b_ptr, c_ptr, w_ptr, slots_ptr, block_expert_ptr, num_slots, N, K,
    a_stride_m, b_stride_e, b_stride_n, c_stride_m,
    ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[slot, n] = sum_k A[slot // ROWS_PER_A, k] * B[expert, n, k] (x the slot's weight),
    for the BLOCK_M sorted slots of program (m, n), all of one expert."""
    slots = tl.load(slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots // ROWS_PER_A, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        a = tl.load(a_ptr + rows[:, None] * a_stride_m + kk[None, :], mask=valid[:, None] & (kk < K)[None, :],
                    other=0.0)
        b = tl.load(b_ptr + expert * b_stride_e + n[None, :] * b_stride_n + kk[:, None],
                    mask=(n < N)[None, :] & (kk < K)[:, None], other=0.0)
        acc += tl.dot(dot_operand(a), dot_operand(b), input_precision="ieee")
    if WEIGHTED:
        acc *= tl.load(w_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + slots.to(tl.int64)[:, None] * c_stride_m + n[None, :]
    tl.store(out, cast_to(acc, c_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
            sorted_slots: torch.Tensor, block_expert: torch.Tensor, rows_per_a: int) -> None:
    num_slots, (n, k) = c.shape[0], b.shape[1:]
    block_n = min(64, triton.next_power_of_2(n))
    # fp32 tiles of 64 x 64 spill on sm_90 (8 bytes): half as deep there
    block_k = min(64 if a.element_size() < 4 else 32, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul[grid](
        a, b, c, weights if weights is not None else c, sorted_slots, block_expert, num_slots, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        ROWS_PER_A=rows_per_a, WEIGHTED=weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )


def fused_experts(
    x: torch.Tensor,  # [tokens, hidden]
    gate_up: torch.Tensor,  # [experts, 2 * intermediate, hidden]: each expert's gate rows, then up rows
    down: torch.Tensor,  # [experts, hidden, intermediate]
    weights: torch.Tensor,  # [tokens, k]: the routing weights (x's dtype)
    ids: torch.Tensor,  # [tokens, k]: the experts, by global index
    first_expert: int = 0,  # the global index of gate_up[0] (a rank's run of experts)
) -> torch.Tensor:  # [tokens, hidden]
    """The experts' weighted sum for every token, by two grouped matmuls; slots routed to
    experts outside [first_expert, first_expert + len(gate_up)) (another rank's) add nothing."""
    tokens, k = ids.shape
    experts, two_i, hidden = gate_up.shape
    local = ids - first_expert
    local = torch.where((local < 0) | (local >= experts), experts, local)  # another rank's: a last bucket
    sorted_slots, block_expert = align(local, experts + 1)
    held = block_expert < experts  # the last bucket's blocks (at the end) are never computed
    block_expert = block_expert[held]
    sorted_slots = sorted_slots[: block_expert.numel() * BLOCK_M]
    if not block_expert.numel():  # no token chose a held expert
        return torch.zeros_like(x)
    h = torch.empty(tokens * k, two_i, dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), gate_up, h, None, sorted_slots, block_expert, rows_per_a=k)
    act = silu_mul(h).contiguous()  # [slots, intermediate]
    y = torch.zeros(tokens * k, hidden, dtype=x.dtype, device=x.device)  # another rank's slots stay 0
    _launch(act, down, y, weights.contiguous().flatten(), sorted_slots, block_expert, rows_per_a=1)
    return y.view(tokens, k, hidden).sum(dim=1)


def reference_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Torch's own: each expert over the tokens routed to it, weighted and added (float32 math;
    the intermediate activations rounded to x's dtype, where `fused_experts` keeps them)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel():
            h = (x[token].float() @ gate_up[e].float().T).to(x.dtype)
            y = silu_mul(h).float() @ down[e].float().T
            out.index_add_(0, token, y * weights[token, slot, None].float())
    return out.to(x.dtype)
