"""Llama, Mistral and Qwen2: the dense decoder as engine/model.py builds it (q|k|v, o, a SiLU
gated MLP, RMS norms, rotary). Qwen2 has biases on q|k|v and never on o; Mistral's window
(every layer) is on unless the config turns it off, Qwen2's off unless it turns it on."""

from __future__ import annotations

from typing import Any

from engine.models.family import Family, attention_biases, uniform_window


def _fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    biases = {"qkv_bias": True, "o_bias": False} if arch == "Qwen2ForCausalLM" else attention_biases(cfg)
    return {**biases, "sliding_window": uniform_window(cfg, on_by_default=arch == "MistralForCausalLM")}


FAMILY = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), _fields)
