"""Qwen3-MoE: Qwen3's attention, and experts in place of the MLP on the sparse layers (every
`decoder_sparse_step`-th, less `mlp_only_layers`); a softmax router whose top-k weights are
renormalised when `norm_topk_prob` says. Shared experts are refused."""

from __future__ import annotations

import re
from typing import Any

from engine.models import qwen3
from engine.models.family import Family, UnsupportedModelError


def _fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported yet")
    # the released checkpoints say num_experts; transformers >= 5 writes num_local_experts
    experts, step = cfg.get("num_experts", cfg.get("num_local_experts", 0)), cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and experts > 0 and (i + 1) % step == 0)
    moe = dict(num_experts=experts, top_k=cfg["num_experts_per_tok"], intermediate_size=cfg["moe_intermediate_size"],
               normalize_top_k=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse) if sparse else None
    return {**qwen3.fields(cfg, arch), "moe": moe}


FAMILY = Family("qwen3-moe", ("Qwen3MoeForCausalLM",), _fields, layer_names={**qwen3.QK_NORMS, "mlp.gate": "moe.gate"},
                expert_names=re.compile(r"mlp\.experts\.(\d+)\.(\w+)"),
                expert_parts={"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                              "down_proj": ("down_proj", None)})
