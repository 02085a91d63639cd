"""Load a Hugging Face safetensors checkpoint into `CausalLM`, fusing q|k|v and gate|up (each
expert's too; experts stored stacked, gpt-oss's, split per expert by engine/stacked_experts.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM
from engine.models import family_of
from engine.models.family import Family
from engine.mtp import OWN_MODULES, SKIPPED
from engine.stacked_experts import StackedExperts, is_stacked

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# The decoder's own names, every family's: checkpoint module inside a layer -> (our
# parameter, shard index within the fused tensor) or our module.
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}


class CheckpointError(ValueError):
    """The checkpoint's tensors do not fit the model (missing, misshapen)."""


# (our parameter name, fused shard index or None, checkpoint tensor) -> the part this model holds
Select = Callable[[str, int | None, torch.Tensor], torch.Tensor]


def load_weights(model: CausalLM, folder: str | Path, select: Select | None = None) -> None:
    """`select`: cuts each checkpoint tensor to the part this model holds, before it is
    checked and placed (a tensor-parallel rank's slice: engine/parallel/sharded_weights.py)."""
    folder = Path(folder)
    family = family_of(model.cfg.architecture)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    params = dict(model.named_parameters())
    fused: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    stacked = StackedExperts()  # experts stored one tensor per layer (gpt-oss)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if family.stacked_experts and is_stacked(name):
                    stacked.add(name, f.get_tensor(name))
                    continue
                target, shard = _map_name(name, family, model.cfg.num_layers, len(model.mtp))
                if target is None or (target == "lm_head.weight" and model.lm_head is None):
                    continue  # tied embeddings: the head is the embedding
                if target not in params:
                    if model.leaves_out(target):  # another rank's expert
                        continue
                    raise CheckpointError(f"{file.name}: tensor {name} has no place in the model")
                tensor = f.get_tensor(name) if select is None else select(target, shard, f.get_tensor(name))
                if shard is None:
                    _copy(params[target], tensor, name)
                    loaded.add(target)
                else:
                    fused.setdefault(target, {})[shard] = tensor
    for target, tensor in stacked.per_expert():
        if target not in params:
            if model.leaves_out(target):
                continue
            raise CheckpointError(f"stacked experts: {target} has no place in the model")
        _copy(params[target], tensor if select is None else select(target, None, tensor), target)
        loaded.add(target)
    for target, shards in fused.items():
        cfg = _layer_of(model, target).cfg  # the layer's own sizes (one rank's, when sharded)
        # gate|up: two halves of the model's own rows (a dense MLP's or an expert's intermediate size)
        rows = [cfg.q_size, cfg.kv_size, cfg.kv_size] if "qkv_proj" in target else [params[target].shape[0] // 2] * 2
        if len(shards) != len(rows):
            raise CheckpointError(f"{target}: found {len(shards)} of {len(rows)} projections")
        for i, n in enumerate(rows):  # check each piece, so a wrong one is named, not mis-split
            want = (n, *params[target].shape[1:])
            if tuple(shards[i].shape) != want:
                raise CheckpointError(f"{target} part {i}: checkpoint shape {tuple(shards[i].shape)} != model {want}")
        _copy(params[target], torch.cat([shards[i] for i in range(len(rows))], dim=0), target)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing and all(m.startswith("mtp.") for m in missing):
        raise CheckpointError(f"checkpoint in {folder} lacks {len(missing)} tensors of its {len(model.mtp)} "
                              f"multi-token-prediction layers (config.json's num_nextn_predict_layers), e.g. "
                              f"{missing[:3]}: load it without them")
    if missing:
        raise CheckpointError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _layer_of(model: CausalLM, target: str) -> torch.nn.Module:
    """The decoder layer a parameter is in: layers.L.* or, in a multi-token-prediction layer, mtp.D.layer.*."""
    kind, index = target.split(".")[:2]
    return model.layers[int(index)] if kind == "layers" else model.mtp[int(index)].layer


def _map_name(name: str, family: Family, num_layers: int, mtp_layers: int = 0) -> tuple[str | None, int | None]:
    """Our parameter name (and fused shard) for a checkpoint tensor; None to skip it. Layers
    past `num_layers` (a family with `extra_layers`: DeepSeek's multi-token prediction) go to
    the first `mtp_layers` MTP layers (engine/mtp.py); beyond those, skipped."""
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    m = _LAYER.fullmatch(name)
    if m is None:
        return name.removeprefix("model."), None
    layer, rest = m.groups()
    if family.extra_layers and int(layer) >= num_layers:
        depth = int(layer) - num_layers
        if depth >= mtp_layers or rest in SKIPPED:
            return None, None
        if rest.rpartition(".")[0] in OWN_MODULES:
            return f"mtp.{depth}.{rest}", None
        target, shard = _map_name(f"model.layers.0.{rest}", family, num_layers)  # as a decoder layer's
        return (None, None) if target is None else (f"mtp.{depth}.layer.{target.removeprefix('layers.0.')}", shard)
    if rest in family.layer_names:  # a tensor the family names itself (gpt-oss's sinks)
        return f"layers.{layer}.{family.layer_names[rest]}", None
    module, _, kind = rest.rpartition(".")
    if module in family.layer_names:  # the family's own first: DeepSeek's q_proj is not a q|k|v part
        return f"layers.{layer}.{family.layer_names[module]}.{kind}", None
    if module in _FUSED or module in family.fused_names:
        target, shard = _FUSED.get(module) or family.fused_names[module]
        return f"layers.{layer}.{target}.{kind}", shard
    if family.expert_names is not None and (e := family.expert_names.fullmatch(module)):
        expert, part = e.groups()
        if part in family.expert_parts:
            target, shard = family.expert_parts[part]
            return f"layers.{layer}.moe.experts.{expert}.{target}.{kind}", shard
    return f"layers.{layer}.{_RENAMED.get(module, module)}.{kind}", None


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise CheckpointError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    param.copy_(value)
