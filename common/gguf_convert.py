"""Convert a llama.cpp GGUF file into a Hugging Face style folder (runs once per file).

The folder holds config.json (LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM, from
llama.cpp's `llama`, `qwen3` and `qwen3moe`), generation_config.json, model.safetensors
(every tensor dequantized to float32; a mixture of experts' stacked expert tensors split
back into one per expert) and the tokenizer files. llama.cpp interleaves the q and k rows of
`llama` models for its RoPE; Qwen's it leaves in rotate-half order.
The folder appears atomically: everything is written into a temporary sibling folder
that is renamed into place last, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen3", "qwen3moe")
# GGUF architecture -> (Hugging Face architecture, model_type)
_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                     "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}

# llama.cpp tensor name (per block or global) -> Hugging Face Llama parameter name.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# A mixture of experts' projections, every expert's stacked in one [experts, out, in] tensor.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture or feature this converter does not handle."""


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into the Hugging Face folder `out_dir` and return `out_dir`.

    `out_dir` must not exist yet; its parent is created if needed. If another process
    finishes converting into the same `out_dir` first, its result is kept and returned.
    Raises UnsupportedGGUFError (naming what) for an architecture not in SUPPORTED_GGUF_ARCHITECTURES or an
    unsupported feature, FileExistsError if `out_dir` exists.
    """
    from gguf import GGUFReader  # heavy-ish import, only needed here

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or pick another folder")
    reader = GGUFReader(gguf_path)
    config = _llama_config(reader)  # validates the architecture before anything is written

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_weights(reader, config, tmp_dir / "model.safetensors")
        _write_json(tmp_dir / "config.json", config)
        _write_json(
            tmp_dir / "generation_config.json",
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config},
        )
        _save_tokenizer(gguf_path, tmp_dir)
        for path in tmp_dir.iterdir():  # mkdtemp and safetensors create owner-only files
            path.chmod(0o644)
        tmp_dir.chmod(0o755)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            shutil.rmtree(tmp_dir)  # a concurrent conversion won the race; keep its folder
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _llama_config(reader: Any) -> dict[str, Any]:
    """config.json contents from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embedding (rope dim {rope_dim} < head dim {head_dim})")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedGGUFError(
            "per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) are not supported"
        )
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.get_field("tokenizer.ggml.tokens").data)
    hf_arch, model_type = _HF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        **({"intermediate_size": int(ffn)} if (ffn := _field(reader, f"{arch}.feed_forward_length")) else {}),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        # GGUF stores eps as float32: its shortest repr gives 1e-05, not 9.999999747378752e-06
        "rms_norm_eps": float(str(np.float32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "qwen3moe":
        experts = int(_field(reader, f"{arch}.expert_count"))
        dense = sorted({int(m.group(1)) for t in reader.tensors if (m := _BLOCK_RE.fullmatch(t.name))
                        and m.group(2) == "ffn_gate"})  # layers llama.cpp wrote a dense MLP for
        config.update(num_experts=experts, num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")),
                      moe_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length")),
                      norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises the top-k weights
                      decoder_sparse_step=1, mlp_only_layers=dense)
        config.setdefault("intermediate_size", config["moe_intermediate_size"])
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor"))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise UnsupportedGGUFError(f"RoPE scaling type {scaling!r} is not supported (only none and linear)")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; a stacked expert tensor's ends in `{expert}`."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
        if part in _EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERT_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaved RoPE row order (back to rotate-half order)."""
    # [n_heads * head_dim, in] -> [n_heads, head_dim/2, 2, in] -> [n_heads, 2, head_dim/2, in]
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if "{expert}" in name:  # [experts, out, in]: one tensor per expert
            for e in range(w.shape[0]):
                tensors[name.format(expert=e)] = np.ascontiguousarray(w[e])
            continue
        interleaved = config["model_type"] == "llama"  # llama.cpp permutes the q/k rows of llama models only
        if interleaved and ".q_proj." in name:
            w = _unpermute_rope_rows(w, config["num_attention_heads"])
        elif interleaved and ".k_proj." in name:
            w = _unpermute_rope_rows(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja.

    transformers' GGUF tokenizer conversion handles every tokenizer.ggml.model kind
    (byte-level BPE, SentencePiece, ...) and takes the chat template from the GGUF field
    tokenizer.chat_template. It is slow to import, which is fine for a one-off conversion.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # facts about this load, not about the tokenizer
        config.pop(key, None)
    _write_json(config_path, config)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
