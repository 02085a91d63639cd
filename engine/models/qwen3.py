"""Qwen3 (dense): Llama's decoder with each q and k head RMS-normed over head_dim before
rotary (one weight per kind), and a head_dim apart from hidden / heads."""

from __future__ import annotations

from typing import Any

from engine.models.family import Family, attention_biases, uniform_window

QK_NORMS = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}


def fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    return {**attention_biases(cfg), "qk_norm": True, "sliding_window": uniform_window(cfg, on_by_default=False)}


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), fields, layer_names=QK_NORMS)
