"""Sampling through the whole engine on a tiny model: seeds, stops, logprobs, aborts."""

from __future__ import annotations

import pytest

from bench.harness.tiny_models import VOCAB, write_tiny_checkpoint
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", seed=7)
    return LLMEngine.from_folder(folder, "float64", CacheConfig(block_size=16, num_blocks=64),
                                 SchedulerConfig(max_num_batched_tokens=64, max_model_len=512))


def run(engine, requests):
    outs = {rid: [] for rid, _, _ in requests}
    reasons = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for d in engine.step():
            outs[d.request_id] += d.token_ids
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    return outs, reasons


PROMPT = list(range(10, 40))


def test_same_seed_same_tokens_whatever_shares_the_batch(engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone, _ = run(engine, [("a", PROMPT, seeded)])
    crowd = [("a", PROMPT, seeded)] + [
        (f"o{i}", list(range(50 + i, 70 + 3 * i)), SamplingParams(temperature=0.8, max_tokens=10 + i))
        for i in range(5)
    ]
    together, _ = run(engine, crowd[::-1])  # other arrival order, other batch rows
    assert together["a"] == alone["a"]
    other_seed, _ = run(engine, [("a", PROMPT, SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                             max_tokens=16, ignore_eos=True))])
    assert other_seed["a"] != alone["a"]


def test_unseeded_sampling_varies_and_stays_in_vocab(engine):
    p = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    outs, _ = run(engine, [(f"r{i}", PROMPT, p) for i in range(4)])
    assert len({tuple(v) for v in outs.values()}) > 1
    assert all(0 <= t < VOCAB for v in outs.values() for t in v)


def test_stop_token_and_max_tokens(engine):
    greedy, _ = run(engine, [("g", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    stop_at = greedy["g"][3]
    first = greedy["g"].index(stop_at)
    outs, reasons = run(engine, [
        ("s", PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,), ignore_eos=True)),
        ("m", PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
    ])
    assert outs["s"] == greedy["g"][:first + 1] and reasons["s"] is FinishReason.STOP
    assert outs["m"] == greedy["g"][:5] and reasons["m"] is FinishReason.LENGTH


def test_logit_bias_forces_a_token(engine):
    outs, _ = run(engine, [("b", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       logit_bias={123: 100.0}))])
    assert outs["b"] == [123] * 4


def test_logprobs_are_returned_per_token(engine):
    engine.add_request("lp", PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))
    got = []
    while engine.has_unfinished():
        got += engine.step()
    assert len(got) == 3
    for d in got:
        (lp,) = d.logprobs
        assert lp.token_id == d.token_ids[0]
        assert len(lp.top) == 4 and lp.top[0][0] == lp.token_id  # greedy: the top token
        assert lp.logprob <= 0.0


def test_abort_mid_generation_frees_blocks(engine):
    engine.add_request("x", PROMPT * 3, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("y", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("x")
    assert not engine.abort_request("x")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
