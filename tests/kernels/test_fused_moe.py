"""The Triton experts (kernels/fused_moe.py) against torch, in Triton's interpreter on CPU:
the slots sorted and padded by expert, the two grouped matmuls against a loop over experts
in float32, and the whole layer against the engine's CPU mixture of experts (engine/moe.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and so triton) are first imported

import pytest
import torch

from engine.config import MoeConfig
from engine.model import Linear
from engine.moe import SparseMoe
from kernels import fused_moe
from kernels import reference as ref

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 48, 40  # sizes no block divides: every edge is masked


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 experts per token, most to experts 0 and 1 (past one block), none to expert 7."""
    g = torch.Generator().manual_seed(seed)
    first = torch.where(torch.rand(tokens, generator=g) < 0.7, 0, torch.randint(1, 7, (tokens,), generator=g))
    second = (first + 1 + torch.randint(0, 5, (tokens,), generator=g)) % 7
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1)
    return weights, torch.stack([first, second], dim=1)


def test_align_sorts_every_slot_once_into_blocks_of_one_expert():
    _, ids = _routing(37, seed=0)
    slots, block_expert = fused_moe.align(ids, EXPERTS, block_m=16)
    real = slots[slots < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))  # each slot exactly once
    assert slots.numel() == block_expert.numel() * 16
    for b, e in enumerate(block_expert.tolist()):
        block = slots[b * 16:(b + 1) * 16]
        assert (ids.flatten()[block[block < ids.numel()]] == e).all()  # one expert's slots only
    assert 7 not in block_expert.tolist()  # an expert no token chose has no block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37])  # a decode of one token; a prefill past a block per expert
def test_fused_experts_match_a_loop_over_experts(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.2).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * 0.2).to(dtype)
    weights, ids = _routing(tokens, seed=tokens)
    weights = weights.to(dtype)
    got = fused_moe.fused_experts(x, gate_up, down, weights, ids)
    want = fused_moe.reference_experts(x, gate_up, down, weights, ids)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_a_ranks_run_of_experts_adds_only_its_experts_share():
    """Expert parallelism: a rank holding experts 2..5 adds their share; the slots routed to
    the others (another rank's) add nothing; a rank no token chose adds zeros."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * 0.2
    weights, ids = _routing(23, seed=3)
    held = (ids >= 2) & (ids < 6)
    want = fused_moe.reference_experts(x, gate_up, down, weights * held, ids)
    got = fused_moe.fused_experts(x, gate_up[2:6], down[2:6], weights, ids, first_expert=2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    nobody = fused_moe.fused_experts(x, gate_up[7:], down[7:], weights, ids, first_expert=7)  # expert 7: unchosen
    assert (nobody == 0).all()


def test_the_fused_layer_equals_the_engines_cpu_mixture_of_experts():
    torch.manual_seed(0)
    cfg = MoeConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTERMEDIATE, normalize_top_k=True,
                    sparse_layers=(0,))
    moe = SparseMoe(HIDDEN, cfg, Linear)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(29, HIDDEN)
    gate_up = torch.stack([moe.experts[str(e)].gate_up_proj.weight for e in range(EXPERTS)])
    down = torch.stack([moe.experts[str(e)].down_proj.weight for e in range(EXPERTS)])
    got = fused_moe.fused_experts(x, gate_up, down, *moe.route(x))
    torch.testing.assert_close(got, moe(x, ref.OPS), **TOL[torch.float32])
