"""SmolLM2-135M-Instruct (the default model) against transformers, in float32."""

from __future__ import annotations

import pytest
import torch

from common.finish_reason import FinishReason
from engine import LLM, SamplingParams
from engine.config import ModelConfig

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint. Once upon a time,",
    "List three colors:",
]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)


def test_config_is_read_from_the_converted_checkpoint(smollm2_dir):
    cfg = ModelConfig.from_pretrained(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0


def test_logits_match_transformers(llm, hf):
    ids = llm.tokenizer.encode(PROMPTS[1])
    engine = llm.engine
    engine.add_request("logits", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    (delta,) = out
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = delta.logprobs[0].top
    ref_top = torch.topk(ref, 5)
    assert [t for t, _ in top] == ref_top.indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref_top.values, atol=2e-3, rtol=0)


def test_greedy_is_token_identical_to_transformers_in_one_batch(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate(PROMPTS, params)  # together: different lengths, chunked prefill
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_chat_answers_paris(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason is FinishReason.STOP


def test_bfloat16_engine_tracks_float32_and_answers_paris(smollm2_dir, llm):
    """bf16 (the serving default, through the packed CPU linears) stays close to float32."""
    bf16 = LLM(model=str(smollm2_dir), dtype="bfloat16", num_kv_blocks=128)
    (out,) = bf16.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text
    ids = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    (ref,) = llm.generate([ids], params)
    (got,) = bf16.generate([ids], params)
    assert got.token_ids == ref.token_ids
    ref_lp, got_lp = dict(ref.logprobs[0].top), dict(got.logprobs[0].top)
    for token in set(ref_lp) & set(got_lp):
        assert abs(ref_lp[token] - got_lp[token]) < 0.25  # bf16 rounding, not a different model
