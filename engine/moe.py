"""Mixture of experts: a router picks each token's top-k experts, and each expert (a SwiGLU
MLP of its own) runs once over the tokens routed to it.

The router is a linear layer to one logit per expert; its softmax (in float32) gives each
token's top-k experts and their weights, renormalised to sum to 1 where the family does
(Mixtral always, Qwen3-MoE by `norm_topk_prob`); gpt-oss's router is biased and takes the
softmax of the top-k logits alone, and its experts have biases and a clamped SwiGLU;
DeepSeek-V3's scores are sigmoids, chosen with a correction bias among the best groups, and
shared experts go beside the routed ones. The experts themselves are the op set's
`moe_experts` (kernels/op_set.py): on CPU the tokens grouped by expert (one stable sort of
the flat (token, slot) assignments), so an expert's packed weights are read once per step
for all its tokens, and each expert's output, scaled by its weight, added back into its
tokens' rows; on the Triton op set two grouped matmuls over the experts' stacked weights
(kernels/fused_moe.py), which `prepare_experts` lays out once.

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
    """One expert: gate|up fused into one matmul, then SiLU(gate) * up (gpt-oss: its clamped
    SwiGLU, `clamped_swiglu`), then down."""

    def __init__(self, hidden: int, intermediate: int, linear: type[nn.Linear], bias: bool = False,
                 clamped: tuple[float, float] | None = None):
        super().__init__()
        self.gate_up_proj = linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = linear(intermediate, hidden, bias=bias)
        self.clamped = clamped

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = ops.silu_mul(gate_up) if self.clamped is None else clamped_swiglu(gate_up, *self.clamped)
        return self.down_proj(h)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over [rows, 2 * ffn] (gate | up halves) -> [rows, ffn]: the gate
    clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoe(nn.Module):
    """The router and the experts this rank holds (`cfg.held`: their global indices; all of
    them without tensor parallelism). `forward` is this rank's share of the layer's output."""

    def __init__(self, hidden: int, cfg: MoeConfig, linear: type[nn.Linear]):
        super().__init__()
        self.cfg = cfg
        self.owned = cfg.experts_held
        # the router (every rank's whole); DeepSeek's reads its weight in float32: a plain nn.Linear,
        # which the model's prepare() does not pack (packing may drop the unpacked weight)
        router = nn.Linear if cfg.deepseek_router else linear
        self.gate = router(hidden, cfg.num_experts, bias=cfg.router_bias)
        self.experts = nn.ModuleDict({str(e): Expert(hidden, cfg.intermediate_size, linear, cfg.expert_bias,
                                                     cfg.clamped_swiglu) for e in self.owned})
        # DeepSeek: added to the sigmoid scores to choose the experts, not to weigh them
        self.correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False) \
            if cfg.correction_bias else None
        # shared experts, as one MLP every token goes through (under tensor parallelism: rank 0's)
        self.shared = Expert(hidden, cfg.shared_intermediate_size, linear) if cfg.shared_intermediate_size else None
        # tokens routed to each expert (all of them: the router is every rank's) since the start
        self.register_buffer("routed", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # set by an op set that reads it

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights: ([n, k] weights in x's dtype, [n, k] ids)."""
        if self.cfg.deepseek_router:
            return self._route_deepseek(x)
        logits = self.gate(x)
        if self.cfg.softmax_after_top_k:  # gpt-oss: the top-k logits, then their softmax
            top, ids = logits.topk(self.cfg.top_k, dim=-1)
            return top.to(torch.promote_types(top.dtype, torch.float32)).softmax(dim=-1).to(x.dtype), ids
        probs = logits.float().softmax(dim=-1)
        weights, ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def _route_deepseek(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's router, in float32 as transformers' (float64 stays float64): sigmoid scores
        (V3) or softmax (V2); V3's correction bias added to choose; with groups, the top-k only
        among the experts of the best groups (a group's score: its two best summed, V2: its
        best); the chosen experts' own scores as weights, renormalised where the config says,
        times the routed scale."""
        cfg = self.cfg
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = torch.nn.functional.linear(x.to(dtype), self.gate.weight.to(dtype))
        scores = logits.sigmoid() if cfg.sigmoid_scores else logits.softmax(dim=-1)
        choice = scores if self.correction_bias is None else scores + self.correction_bias.to(dtype)
        if cfg.groups is not None:
            groups, keep = cfg.groups
            per_group = choice.view(-1, groups, cfg.num_experts // groups)
            group_score = per_group.max(dim=-1).values if cfg.group_by_max else \
                per_group.topk(2, dim=-1).values.sum(dim=-1)
            best = group_score.topk(keep, dim=-1, sorted=False).indices
            mask = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~mask.repeat_interleave(cfg.num_experts // groups, dim=1), float("-inf"))
        ids = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if cfg.normalize_top_k:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * cfg.routed_scale).to(x.dtype), ids

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def held(self) -> range:
        return self.owned

    @property
    def plain(self) -> bool:
        return not self.cfg.expert_bias and self.cfg.clamped_swiglu is None

    def run(self, expert: int, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return self.experts[str(expert)](x, ops)

    def stack(self) -> None:
        """The held experts' weights as two stacked tensors, each expert's linears views of them
        (one copy in memory): the layout a fused kernel reads (kernels/fused_moe.py)."""
        if self.stacked is not None:
            return
        experts = [self.experts[str(e)] for e in self.owned]
        gate_up = torch.stack([e.gate_up_proj.weight for e in experts])
        down = torch.stack([e.down_proj.weight for e in experts])
        for i, e in enumerate(experts):
            e.gate_up_proj.weight = nn.Parameter(gate_up[i], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self.stacked = (gate_up, down)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        weights, ids = self.route(x)
        counts = torch.bincount(ids.flatten(), minlength=self.cfg.num_experts)  # once: the metric's and the grouping's
        self.routed += counts
        out = ops.moe_experts(x, weights, ids, self, counts)
        return out if self.shared is None else out + self.shared(x, ops)
