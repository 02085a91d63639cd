"""Mixtral: Mistral's attention (its window on every layer), experts on every layer
(`block_sparse_moe`, w1 / w3 / w2 for gate / up / down), top-k weights always renormalised."""

from __future__ import annotations

import re
from typing import Any

from engine.models.family import Family, attention_biases, uniform_window


def _fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    moe = dict(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
               intermediate_size=cfg["intermediate_size"], normalize_top_k=True,
               sparse_layers=tuple(range(cfg["num_hidden_layers"])))
    return {**attention_biases(cfg), "sliding_window": uniform_window(cfg, on_by_default=True), "moe": moe}


FAMILY = Family("mixtral", ("MixtralForCausalLM",), _fields, layer_names={"block_sparse_moe.gate": "moe.gate"},
                expert_names=re.compile(r"block_sparse_moe\.experts\.(\d+)\.(\w+)"),
                expert_parts={"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)})
