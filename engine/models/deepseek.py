"""DeepSeek-V3 and V2 (V2-Lite: no q LoRA): multi-head latent attention (engine/mla.py) over
a latent KV cache, and a mixture of experts with sigmoid scores and a correction bias for
choosing (V2: softmax scores), group-limited top-k, a routed scaling factor and shared
experts; the first `first_k_dense_replace` layers dense. The multi-token-prediction layers a checkpoint carries
(layers past `num_hidden_layers`, `num_nextn_predict_layers` of them) are not part of the
decoder: loaded into engine/mtp.py's layers when asked, skipped otherwise."""

from __future__ import annotations

import re
from typing import Any

from engine.models.family import Family, attention_biases, yarn_mscale


def _fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    qk_head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2  # DeepSeek's YaRN softmax correction
    mla = dict(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
               qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
               v_head_dim=cfg["v_head_dim"], softmax_scale=scale,
               rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))
    experts, layers = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0, cfg["num_hidden_layers"]
    sparse = tuple(range(cfg.get("first_k_dense_replace", 0), layers)) if experts else ()
    v2 = arch == "DeepseekV2ForCausalLM"
    groups = (cfg.get("n_group") or 1, cfg.get("topk_group") or 1)
    if v2 and cfg.get("topk_method", "greedy") != "group_limited_greedy":
        groups = (1, 1)  # V2's greedy: the top-k of all experts
    moe = dict(num_experts=experts, top_k=cfg.get("num_experts_per_tok") or 1,
               intermediate_size=cfg.get("moe_intermediate_size") or 0,
               normalize_top_k=not v2 and bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
               deepseek_router=True, sigmoid_scores=not v2, correction_bias=not v2, group_by_max=v2,
               groups=groups if groups != (1, 1) else None,
               routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
               shared_intermediate_size=(cfg.get("moe_intermediate_size") or 0) * (cfg.get("n_shared_experts") or 0))
    entry = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    # the pool's one "KV head": K and V planes each half a token's latent entry
    mtp = 0 if v2 else cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0  # V3's only
    return {**attention_biases(cfg), "mla": mla, "moe": moe if sparse else None, "num_kv_heads": 1,
            "head_dim": -(-entry // 2), "mtp_layers": int(mtp)}


_ATTENTION = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")

FAMILY = Family(
    "deepseek", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), _fields,
    layer_names={**{f"self_attn.{m}": f"mla.{m}" for m in _ATTENTION}, "mlp.gate": "moe.gate",
                 "mlp.gate.e_score_correction_bias": "moe.correction_bias",
                 "mlp.shared_experts.down_proj": "moe.shared.down_proj"},
    fused_names={"mlp.shared_experts.gate_proj": ("moe.shared.gate_up_proj", 0),
                 "mlp.shared_experts.up_proj": ("moe.shared.gate_up_proj", 1)},
    expert_names=re.compile(r"mlp\.experts\.(\d+)\.(\w+)"),
    expert_parts={"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)},
    extra_layers=True)
