"""A mixture of experts' routing: each token's experts and weights as the family says, the
grouped computation equal to every expert run on every token and weighted, and the tokens
routed to each expert counted for /metrics (the token-level match with transformers is
tests/engine/test_model_vs_hf.py's, over the qwen3-moe and mixtral checkpoints)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from bench.harness.tiny_models import write_tiny_checkpoint
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, ModelConfig, MoeConfig, SchedulerConfig, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.model import Linear
from engine.moe import SparseMoe
from kernels import get_ops
from worker import moe_metrics

HIDDEN = 32


@pytest.mark.parametrize("normalize", [True, False])
def test_the_grouped_experts_equal_every_expert_weighted_by_its_route(normalize):
    torch.manual_seed(0)
    cfg = MoeConfig(num_experts=6, top_k=2, intermediate_size=24, normalize_top_k=normalize, sparse_layers=(0,))
    moe = SparseMoe(HIDDEN, cfg, Linear).double()
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(11, HIDDEN, dtype=torch.float64)
    probs = (x @ moe.gate.weight.T).float().softmax(-1)  # in float32, as transformers' routers
    top, ids = probs.topk(2, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    top = top.double()
    dense = torch.zeros_like(x)  # every expert on every token, weighted by the route (0 off it)
    for e in range(cfg.num_experts):
        w = (top * (ids == e)).sum(-1, keepdim=True)
        gate, up = (x @ moe.experts[str(e)].gate_up_proj.weight.T).chunk(2, dim=-1)
        dense += w * ((torch.nn.functional.silu(gate) * up) @ moe.experts[str(e)].down_proj.weight.T)
    torch.testing.assert_close(moe(x, get_ops("cpu")), dense, rtol=0, atol=1e-12)
    assert moe.routed.tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()


def test_a_config_with_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=3"):
        MoeConfig(num_experts=2, top_k=3, intermediate_size=8, normalize_top_k=True, sparse_layers=(0,))


def test_the_routed_tokens_are_counted_per_expert_and_exported(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "moe", "qwen3-moe")
    cfg = ModelConfig.from_pretrained(folder)
    assert cfg.moe is not None and cfg.moe.sparse_layers == (1,)  # layer 0 dense (mlp_only_layers)
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(block_size=16, num_blocks=32),
                                   SchedulerConfig(max_model_len=256))
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    computed = sum(len(p) for p in prompts) + 3 * 3  # each prompt, then 3 more tokens each (the 4th is not fed)
    routed = engine.routed_tokens_per_expert()
    assert len(routed) == cfg.moe.num_experts and sum(routed) == computed * cfg.moe.top_k
    moe_metrics.watch(engine.routed_tokens_per_expert)
    exported = {s.labels["expert"]: s.value for f in REGISTRY.collect() if f.name == moe_metrics.NAME
                for s in f.samples if s.name == moe_metrics.NAME + "_total"}
    assert exported == {str(e): n for e, n in enumerate(routed)}
