"""Checkpoint configs and weights: what the engine accepts, and clear errors for the rest."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.harness.tiny_models import write_tiny_checkpoint
from engine.config import CacheConfig, ModelConfig, UnsupportedModelError
from engine.models import SUPPORTED_ARCHITECTURES
from engine.model import CausalLM
from engine.weights import CheckpointError, load_weights


def base_config(**overrides):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=32, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg.update(overrides)
    return cfg


def test_unsupported_architecture_is_named_with_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dict(base_config(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("overrides,match", [
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "longrope"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "gptq"),
    (dict(quantization_config={"quant_method": "mxfp4"}), "llama loads no quantized checkpoint"),  # gpt-oss's only
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "dynamic"),
    (dict(hidden_act="gelu"), "gelu"),
    # Qwen3's window on the layers from max_window_layers on: a window on some layers only
    (dict(architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True,
          layer_types=["full_attention", "sliding_attention"]), "some layers only"),
])
def test_configs_the_model_cannot_honour_are_refused(overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict(base_config(**overrides))


def test_rope_and_bias_fields_are_read_in_both_config_styles():
    old = ModelConfig.from_dict(base_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    new = ModelConfig.from_dict(base_config(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}))
    assert old.rope == new.rope and old.rope.theta == 5e5 and old.rope.factor == 2.0
    qwen = ModelConfig.from_dict(base_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen.qkv_bias and not qwen.o_bias
    mistral = ModelConfig.from_dict(base_config(architectures=["MistralForCausalLM"], sliding_window=64))
    assert mistral.max_model_len == 64  # full attention is exact only up to the window


def test_missing_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base_config()))
    model = CausalLM(ModelConfig.from_pretrained(tmp_path), torch.float32)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights(model, tmp_path)


def test_incomplete_or_misshapen_checkpoints_are_refused(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    cfg = ModelConfig.from_pretrained(folder)
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights_file)
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        load_weights(CausalLM(cfg, torch.float32), folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, weights_file)
    with pytest.raises(CheckpointError, match="shape"):
        load_weights(CausalLM(cfg, torch.float32), folder)


def test_cache_config_validates_and_sizes_the_pool():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)
    assert CacheConfig(block_size=16, num_blocks=7).resolve_num_blocks(1000) == 7
    assert CacheConfig(block_size=16, memory_gib=1.0).resolve_num_blocks(2**10) == 2**16
