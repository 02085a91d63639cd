"""The model registry (engine/models/): every family module is listed, and every architecture
it reads has a tiny checkpoint kind that tests/engine/test_model_vs_hf.py compares with
transformers, so a family cannot be added without the test that checks it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from bench.harness.tiny_models import KINDS
from engine.config import ModelConfig, UnsupportedModelError
from engine.models import FAMILIES, SUPPORTED_ARCHITECTURES, find_family

MODELS = Path(__file__).resolve().parents[2] / "engine" / "models"


def test_every_family_module_is_in_the_registry():
    modules = sorted(p.stem for p in MODELS.glob("*.py") if p.stem not in ("__init__", "family"))
    listed = {importlib.import_module(f"engine.models.{m}").FAMILY for m in modules}
    assert listed == set(FAMILIES)
    assert len(SUPPORTED_ARCHITECTURES) == len(set(SUPPORTED_ARCHITECTURES))  # no architecture in two families


def test_every_architecture_has_a_tiny_checkpoint_compared_with_transformers():
    written = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[getattr(transformers, cls).model_type] for cls, _ in KINDS.values()}
    assert set(SUPPORTED_ARCHITECTURES) <= written, set(SUPPORTED_ARCHITECTURES) - written


@pytest.mark.parametrize("archs", [["BertForMaskedLM"], []])
def test_an_architecture_no_family_reads_is_named_with_the_supported_ones(archs):
    with pytest.raises(UnsupportedModelError) as e:
        find_family(archs, "bert")
    assert str(archs or "bert") in str(e.value) and all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_a_family_reads_its_own_fields_and_the_shared_ones_are_read_for_all():
    shared = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    qwen2 = ModelConfig.from_dict({**shared, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.moe) == (True, False, False, None)
    oss = ModelConfig.from_dict({**shared, "architectures": ["GptOssForCausalLM"], "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "sliding_window": 16, "attention_bias": True,
                                 "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert oss.window_layers == (0, 2) and oss.attention_sinks and oss.max_model_len == 128
    assert oss.moe.sparse_layers == (0, 1, 2, 3) and oss.moe.softmax_after_top_k
    assert oss.moe.clamped_swiglu == (1.702, 7.0)
    assert (oss.qkv_bias, oss.o_bias, oss.hidden_size, oss.num_kv_heads) == (True, True, 32, 2)
