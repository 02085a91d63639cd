"""gpt-oss's released form: experts in MXFP4 (4-bit values, a power-of-two scale per block of
32), dequantized at load. The reference is transformers' own dequantization: the engine on
the MXFP4 checkpoint gives the tokens transformers gives on the checkpoint it dequantized.
(Sinks, windows, YaRN and the clamped experts against transformers: tests/engine/test_model_vs_hf.py.)"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from bench.harness.tiny_models import VOCAB, load_hf, write_tiny_checkpoint
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine


def _mxfp4(folder, dequantized, seed: int) -> None:
    """Rewrite `folder`'s experts as random MXFP4 blocks and scales, and `dequantized` as the
    same checkpoint with transformers' dequantization of them in their place."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    plain = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape  # stored [experts, in, out]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(127 - 6, 127 - 3, (experts, outputs, inputs // 32), generator=g, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    dequantized.mkdir()
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    for extra in folder.glob("*.json"):
        (dequantized / extra.name).write_text(extra.read_text())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_experts_give_the_tokens_of_transformers_dequantized_checkpoint(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "mxfp4", "gpt-oss", seed=11)
    _mxfp4(folder, tmp_path / "dequantized", seed=11)
    hf = load_hf(tmp_path / "dequantized", torch.float32)
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(block_size=16, num_blocks=16),
                                   SchedulerConfig(max_model_len=256))
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate((23, 9)):
        prompt = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        got = []
        while engine.has_unfinished():
            for d in engine.step():
                got.extend(d.token_ids)
        assert got == want
