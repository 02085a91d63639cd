"""One tensor-parallel rank's share of the Llama-family decoder, still a `CausalLM`.

Megatron's split: q|k|v and gate|up are column-parallel (each rank computes its heads and
its intermediate columns, no communication), o_proj and down_proj are row-parallel (each
rank's partial product, summed by one all-reduce each: two per layer). A mixture of experts
is split by whole experts instead (each rank's experts for every token, one all-reduce). The embedding and
the LM head are split by vocabulary rows: a rank looks up only the ids it owns (zeros
elsewhere) and one all-reduce sums the rows; the head's logits are all-gathered, so every
rank holds the whole [rows, vocab] and the runner and sampler see a model like any other.
The layers are built from the rank's local config (engine/parallel/layout.py); `cfg` stays
the full model's, which is what the runner, the sampler and the scheduler read.
"""

from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn

from engine.config import ModelConfig
from engine.model import CausalLM, Linear
from engine.moe import SparseMoe
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.rank_clock import CollectiveTimer


class RowParallelLinear(Linear):
    """This rank's input columns of a linear layer; the output summed over the group. The
    bias (if any) is held by rank 0 only, so it is added once."""

    group: dist.ProcessGroup | None = None
    timer: CollectiveTimer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [num_tokens, out]: this rank's partial sum
        t0 = perf_counter()
        dist.all_reduce(out, group=self.group)
        self.timer.seconds += perf_counter() - t0
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the embedding; ids outside them read zeros,
    and the all-reduce fills them from the rank that owns them."""

    start: int = 0
    group: dist.ProcessGroup | None = None
    timer: CollectiveTimer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        t0 = perf_counter()
        dist.all_reduce(out, group=self.group)
        self.timer.seconds += perf_counter() - t0
        return out


class ShardedCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, layout: TensorParallelLayout, dtype: torch.dtype, device: str = "cpu",
                 group: dist.ProcessGroup | None = None, mtp: bool = False):
        self.local_cfg = layout.local_config(cfg)
        super().__init__(self.local_cfg, dtype, device, mtp)
        self.cfg = cfg
        self.layout = layout
        self.group = group
        self.collectives = CollectiveTimer()  # seconds this rank spent in the group's collectives
        embed = VocabParallelEmbedding(self.local_cfg.vocab_size, cfg.hidden_size,
                                       _weight=torch.empty(self.local_cfg.vocab_size, cfg.hidden_size))
        embed.start, embed.group, embed.timer = layout.vocab.start, group, self.collectives
        self.embed_tokens = embed.requires_grad_(False).to(dtype=dtype, device=device)
        for layer in self.decoder_layers():
            layer.o_proj = _row_parallel(layer.o_proj, group, self.collectives)
            if layer.moe is not None:
                layer.moe = _expert_parallel(layer.moe, group, self.collectives)
            else:
                layer.down_proj = _row_parallel(layer.down_proj, group, self.collectives)

    def leaves_out(self, target: str) -> bool:
        """Another rank's expert (expert parallelism), or rank 0's shared experts."""
        _, moe, rest = target.partition(".moe.")  # layers.L.moe.experts.E.<projection>.weight (or mtp.D.layer.moe...)
        if not moe:
            return False
        if rest.startswith("shared."):
            return self.layout.rank != 0
        parts = rest.split(".")
        return parts[0] == "experts" and len(parts) > 1 and int(parts[1]) not in self.layout.experts

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32, on every rank
        local = super().compute_logits(hidden)  # [rows, this rank's vocab rows]
        pad = self.layout.vocab_rows_max - local.shape[1]
        if pad:
            local = nn.functional.pad(local, (0, pad))
        parts = [torch.empty_like(local) for _ in range(self.layout.size)]
        t0 = perf_counter()
        dist.all_gather(parts, local.contiguous(), group=self.group)
        self.collectives.seconds += perf_counter() - t0
        return torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]


class ExpertParallelMoe(SparseMoe):
    """This rank's experts' share of a mixture of experts for every token; the shares summed
    over the group by one all-reduce (each token's experts may live on any rank)."""

    group: dist.ProcessGroup | None = None
    timer: CollectiveTimer

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        out = super().forward(x, ops)
        t0 = perf_counter()
        dist.all_reduce(out, group=self.group)
        self.timer.seconds += perf_counter() - t0
        return out


def _expert_parallel(moe: SparseMoe, group: dist.ProcessGroup | None, timer: CollectiveTimer) -> ExpertParallelMoe:
    parallel = ExpertParallelMoe(moe.gate.in_features, moe.cfg, Linear)
    parallel.group, parallel.timer = group, timer
    weight = moe.gate.weight
    return parallel.requires_grad_(False).to(dtype=weight.dtype, device=weight.device)


def _row_parallel(linear: Linear, group: dist.ProcessGroup | None, timer: CollectiveTimer) -> RowParallelLinear:
    row = RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    row.group, row.timer = group, timer
    return row.requires_grad_(False).to(dtype=linear.weight.dtype, device=linear.weight.device)
