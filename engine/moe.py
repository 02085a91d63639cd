"""Mixture of experts: a router picks each token's top-k experts, and each expert (a SwiGLU
MLP of its own) runs once over the tokens routed to it.

The router is a linear layer to one logit per expert; its softmax (in float32) gives each
token's top-k experts and their weights, renormalised to sum to 1 where the family does
(Mixtral always, Qwen3-MoE by `norm_topk_prob`). The tokens are then grouped by expert (one
stable sort of the flat (token, slot) assignments), so an expert's weights are read once per
step for all its tokens, as a grouped matmul over the rows routed to it, and each expert's
output, scaled by its weight, is added back into its tokens' rows.

Under tensor parallelism the experts are split across the ranks (expert parallelism): a
rank holds `experts` (the ones it owns, by global index) and the whole router; it computes
its experts' share for every token and the group's all-reduce (the caller's) sums the shares.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import MoeConfig
from kernels.op_set import OpSet


class Expert(nn.Module):
    """One expert: gate|up fused into one matmul, then SiLU(gate) * up, then down."""

    def __init__(self, hidden: int, intermediate: int, linear: type[nn.Linear]):
        super().__init__()
        self.gate_up_proj = linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class SparseMoe(nn.Module):
    """The router and the experts this rank holds (`cfg.held`: their global indices; all of
    them without tensor parallelism). `forward` is this rank's share of the layer's output."""

    def __init__(self, hidden: int, cfg: MoeConfig, linear: type[nn.Linear]):
        super().__init__()
        self.cfg = cfg
        self.owned = cfg.experts_held
        self.gate = linear(hidden, cfg.num_experts, bias=False)  # the router (every rank's whole)
        self.experts = nn.ModuleDict({str(e): Expert(hidden, cfg.intermediate_size, linear) for e in self.owned})
        # tokens routed to each expert (all of them: the router is every rank's) since the start
        self.register_buffer("routed", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights: ([n, k] weights in x's dtype, [n, k] ids)."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        weights, ids = self.route(x)
        k = self.cfg.top_k
        flat = ids.flatten()  # slot j of token t at t * k + j
        order = flat.argsort(stable=True)  # the assignments grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.cfg.num_experts)
        self.routed += counts
        ends = counts.cumsum(0).tolist()
        out = torch.zeros_like(x)
        flat_weights = weights.flatten()
        for e in self.owned:
            start, end = (ends[e - 1] if e else 0), ends[e]
            if start == end:
                continue
            slots = order[start:end]
            tokens = slots // k
            y = self.experts[str(e)](x[tokens], ops) * flat_weights[slots, None]
            out.index_add_(0, tokens, y)
        return out
