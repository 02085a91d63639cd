"""What a model family is to the engine: one `Family` per module of engine/models/.

A family names the `architectures` of config.json it reads, turns a config.json into the
`ModelConfig` fields that are its own (`config_fields`: the shared ones, sizes, heads, rope,
tokens, are read by engine/config.py for every family), and says how its checkpoint names
what the decoder (engine/model.py) holds: tensors inside a layer it renames, its experts'
names, whether they are stored stacked. Its KV is the decoder's per-head K/V on every layer;
what differs per layer is in its fields (`window_layers`: the layers that read only their
last `sliding_window` positions). A family is plain data and functions over dicts: nothing
here imports the engine, so engine/config.py can read the registry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine cannot run (names what and why)."""


@dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class Family:
    name: str
    architectures: tuple[str, ...]
    # (config.json, the architecture) -> ModelConfig fields beyond the shared ones: qkv_bias,
    # o_bias, qk_norm, sliding_window, window_layers, attention_sinks, and `moe` as a dict of
    # MoeConfig fields (None for a dense family); unset fields keep ModelConfig's defaults
    config_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    # inside a layer: a checkpoint tensor ("self_attn.sinks") or module ("mlp.router") name -> ours
    layer_names: Mapping[str, str] = field(default_factory=dict)
    # one expert's tensors (module name, groups: expert index, projection) and each projection
    # as (our parameter, its shard in the fused gate|up or None)
    expert_names: re.Pattern | None = None
    expert_parts: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)
    # inside a layer: checkpoint modules fused into one of ours -> (ours, shard), beyond q|k|v and gate|up
    fused_names: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    stacked_experts: bool = False  # every expert of a layer in one tensor (engine/stacked_experts.py)
    extra_layers: bool = False  # layers past num_hidden_layers: DeepSeek's multi-token prediction (engine/mtp.py)
    quantization: tuple[str, ...] = ()  # quantization_config quant_methods it loads (dequantized)


def attention_biases(cfg: dict[str, Any]) -> dict[str, bool]:
    """q|k|v and o biases as `attention_bias` says (both or neither)."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def uniform_window(cfg: dict[str, Any], on_by_default: bool) -> int | None:
    """The sliding window of a family whose every layer has it (None: none). `use_sliding_window`
    turns it on or off (default `on_by_default`); a window on some layers only in Qwen2/3's form
    (`max_window_layers`, `layer_types`) is refused."""
    if not cfg.get("sliding_window") or not cfg.get("use_sliding_window", on_by_default):
        return None
    layer_types = set(cfg.get("layer_types") or ())
    if len(layer_types) > 1:
        raise UnsupportedModelError(
            f"a sliding window on some layers only (layer_types {sorted(layer_types)}) is not supported: "
            "every layer attends to the whole sequence, or every layer to the window")
    return int(cfg["sliding_window"])


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original: 0.1 m ln(scale) + 1
    (1 at scale <= 1), as transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
