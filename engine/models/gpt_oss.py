"""gpt-oss: attention with biases and sinks (a learned logit per head in every softmax), a
window on the layers `layer_types` names `sliding_attention`; experts on every layer, biased,
with a clamped SwiGLU, behind a biased router whose softmax takes the top-k logits alone;
the experts stored stacked per layer, the released checkpoints' in MXFP4 (dequantized at
load: engine/stacked_experts.py)."""

from __future__ import annotations

from typing import Any

from engine.models.family import Family, attention_biases


def _fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    layers = tuple(i for i, t in enumerate(cfg.get("layer_types") or ()) if t == "sliding_attention")
    moe = dict(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
               intermediate_size=cfg["intermediate_size"], normalize_top_k=False,
               sparse_layers=tuple(range(cfg["num_hidden_layers"])), router_bias=True, softmax_after_top_k=True,
               expert_bias=True,
               clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))))
    return {**attention_biases(cfg), "sliding_window": window, "window_layers": layers if window else (),
            "attention_sinks": True, "moe": moe}


FAMILY = Family("gpt-oss", ("GptOssForCausalLM",), _fields,
                layer_names={"self_attn.sinks": "sinks", "mlp.router": "moe.gate"},
                stacked_experts=True, quantization=("mxfp4",))
