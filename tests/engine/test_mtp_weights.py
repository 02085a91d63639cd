"""DeepSeek-V3's multi-token-prediction layer loads (engine/mtp.py) when asked, whole at one
rank and sliced like the decoder's layers at tensor-parallel degree 2, and is skipped
otherwise. transformers builds no MTP module (its DeepSeek-V3 ignores model.layers.61.*), so
the test writes the layer the released checkpoint's way: its decoder layer's tensors under
the next layer index, beside enorm, hnorm, eh_proj and the shared head."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.harness.tiny_models import write_tiny_checkpoint
from engine.config import ModelConfig
from engine.model import CausalLM
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.sharded_model import ShardedCausalLM
from engine.parallel.sharded_weights import rank_slicer
from engine.weights import CheckpointError, load_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 (2 layers, layer 1 with experts) and its MTP layer, model.layers.2."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("dsv3") / "m", "deepseek-v3", seed=3,
                                   num_nextn_predict_layers=1)
    gen = torch.Generator().manual_seed(11)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    h, vocab = tensors["model.embed_tokens.weight"].shape[1], tensors["model.embed_tokens.weight"].shape[0]
    mtp = {k.replace("model.layers.1.", "model.layers.2."): torch.randn(v.shape, generator=gen)
           for k, v in tensors.items() if k.startswith("model.layers.1.")}
    for name, shape in [("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)), ("shared_head.norm", (h,)),
                        ("shared_head.head", (vocab, h))]:
        mtp[f"model.layers.2.{name}.weight"] = torch.randn(shape, generator=gen)
    mtp["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]  # the released layout's copy
    save_file(mtp, str(folder / "model-mtp.safetensors"))
    return folder, mtp


def test_the_mtp_layer_loads_when_asked_and_is_skipped_otherwise(checkpoint):
    folder, mtp = checkpoint
    cfg = ModelConfig.from_pretrained(folder)
    assert cfg.mtp_layers == 1
    plain = CausalLM(cfg, torch.float32)
    load_weights(plain, folder)  # the MTP tensors have no place: skipped
    assert len(plain.mtp) == 0

    model = CausalLM(cfg, torch.float32, mtp=True)
    load_weights(model, folder)
    layer = model.mtp[0]
    assert torch.equal(layer.eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])
    assert torch.equal(layer.shared_head.head.weight, mtp["model.layers.2.shared_head.head.weight"])
    assert torch.equal(layer.hnorm.weight, mtp["model.layers.2.hnorm.weight"])
    assert torch.equal(layer.layer.mla.kv_b_proj.weight, mtp["model.layers.2.self_attn.kv_b_proj.weight"])
    assert layer.layer.moe is not None  # its decoder layer has experts, as the last decoder layer does
    gate_up = torch.cat([mtp["model.layers.2.mlp.experts.5.gate_proj.weight"],
                         mtp["model.layers.2.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(layer.layer.moe.experts["5"].gate_up_proj.weight, gate_up)
    assert torch.equal(layer.layer.moe.correction_bias, mtp["model.layers.2.mlp.gate.e_score_correction_bias"])
    loaded = dict(model.named_parameters())
    for name, a in plain.named_parameters():  # the decoder's own are untouched
        assert torch.equal(a, loaded[name]), name


def test_a_rank_holds_its_slices_of_the_mtp_layer(checkpoint):
    folder, mtp = checkpoint
    cfg = ModelConfig.from_pretrained(folder)
    layout = TensorParallelLayout.of(cfg, 2, 1)
    model = ShardedCausalLM(cfg, layout, torch.float32, mtp=True)
    load_weights(model, folder, rank_slicer(cfg, layout))
    layer = model.mtp[0]
    vocab = mtp["model.layers.2.shared_head.head.weight"][layout.vocab.start:layout.vocab.stop]
    assert torch.equal(layer.shared_head.head.weight, vocab)
    rows = cfg.mla.qk_head_dim
    q_b = mtp["model.layers.2.self_attn.q_b_proj.weight"][layout.q_heads.start * rows:layout.q_heads.stop * rows]
    assert torch.equal(layer.layer.mla.q_b_proj.weight, q_b)
    assert torch.equal(layer.eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])  # replicated, like the latent's
    held = sorted({int(n.split(".")[1]) for n, _ in layer.layer.moe.named_parameters() if n.startswith("experts.")})
    assert held and set(held) == set(layout.experts)
    assert not any("shared" in n for n, _ in layer.layer.moe.named_parameters())  # rank 0's


def test_asking_for_mtp_layers_a_checkpoint_lacks_names_them(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "deepseek-v3", num_nextn_predict_layers=1)
    with pytest.raises(CheckpointError, match="multi-token-prediction"):
        load_weights(CausalLM(ModelConfig.from_pretrained(folder), torch.float32, mtp=True), folder)
