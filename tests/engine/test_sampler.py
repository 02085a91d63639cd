"""Sampler tests: tiny vocabularies, no model, fixed generators (no flaky statistics)."""

from __future__ import annotations

import struct

import pytest
import torch

from common.sampling_params import SamplingParams, SamplingParamsError
from engine.sampler import Sampler, SamplingMetadata, process_logits, sampling_probs
from engine.seeded_random import seeded_exponentials

VOCAB = 50
PROBS5 = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])


def meta_for(params, vocab=VOCAB, prompts=None, outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        vocab,
        "cpu",
    )


def sample(logits, params, outputs=None, seed=0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return Sampler(gen)(logits, meta_for(params, logits.shape[1], outputs=outputs)).token_ids


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float()


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    expected = probs * len(tokens)
    return float(((counts_of(tokens, len(probs)) - expected) ** 2 / expected).sum())


# df = 4: P(chi2 > 40) ~ 4e-8, so a correct sampler essentially never trips this bound, while
# sampling from a wrong distribution does (moving 0.03 of mass between the top two tokens
# gives chi2 ~ 90 over 20k draws).
CHI2_BOUND_DF4 = 40.0


def test_greedy_is_argmax():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 8
    assert sample(logits, params) == logits.argmax(-1).tolist()


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=3) for i in range(6)]
    tokens = sample(logits, params)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def test_input_logits_not_modified():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    params = [SamplingParams(top_k=2, top_p=0.5, min_p=0.1, logit_bias={1: 5.0},
                             repetition_penalty=1.5, presence_penalty=1.0)] * 3
    sample(logits, params, outputs=[[1, 2]] * 3)
    assert torch.equal(logits, before)


def test_unseeded_frequencies_match_softmax():
    n = 20_000
    logits = PROBS5.log().expand(n, 5).clone()
    tokens = sample(logits, [SamplingParams()] * n, seed=3)
    assert chi_square(tokens, PROBS5) < CHI2_BOUND_DF4


def test_seeded_frequencies_match_softmax():
    # One draw per seed: checks the hash gives independent, uniform randomness across seeds.
    n = 20_000
    logits = PROBS5.log().expand(n, 5).clone()
    tokens = sample(logits, [SamplingParams(seed=s) for s in range(n)])
    assert chi_square(tokens, PROBS5) < CHI2_BOUND_DF4


def test_seeded_frequencies_over_positions_match_softmax():
    # One seed, many output positions: the position counter drives a fresh draw per step.
    n = 20_000
    logits = PROBS5.log().expand(n, 5).clone()
    tokens = sample(logits, [SamplingParams(seed=7)] * n, outputs=[range(i) for i in range(n)])
    assert chi_square(tokens, PROBS5) < CHI2_BOUND_DF4


def test_seeded_row_is_independent_of_batch_and_history():
    gen = torch.Generator().manual_seed(4)
    row = torch.randn(1, VOCAB, generator=gen)
    others = torch.randn(5, VOCAB, generator=gen)
    mine = SamplingParams(seed=1234)
    out = [[3, 4, 5]]  # position 3
    alone = sample(row, [mine], outputs=out)[0]

    neighbours = [
        SamplingParams(),
        SamplingParams(seed=99),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=2, top_p=0.5, min_p=0.2, seed=5),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={0: 3.0}),
    ]
    for pos in range(6):
        logits = torch.cat([others[:pos], row, others[pos:]])
        params = neighbours[:pos] + [mine] + neighbours[pos:]
        outputs = [[1, 2]] * pos + out + [[1, 2]] * (5 - pos)
        for gen_seed in (0, 1):  # whatever the unseeded generator did before
            assert sample(logits, params, outputs, seed=gen_seed)[pos] == alone
    assert all(sample(row, [mine], outputs=out, seed=s)[0] == alone for s in range(5))


def test_different_seeds_give_different_samples():
    logits = torch.zeros(200, VOCAB)  # uniform over 50 tokens
    tokens = sample(logits, [SamplingParams(seed=s) for s in range(200)])
    assert len(set(tokens)) > 30  # 200 uniform draws over 50 cover ~49 tokens


def test_hash_matches_reference_murmur3():
    def murmur3_32(data: bytes, seed: int = 0) -> int:
        m = 0xFFFFFFFF
        rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m  # noqa: E731
        h = seed
        for (k,) in struct.iter_unpack("<I", data):
            k = rotl((k * 0xCC9E2D51) & m, 15) * 0x1B873593 & m
            h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
        h ^= len(data)
        h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
        h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
        return h ^ (h >> 16)

    seeds = [0, 1, 2**32 - 1, 2**40 + 17, 2**63 - 1]
    positions = [0, 5, 123456, 2**31 + 3, 7]
    got = seeded_exponentials(torch.tensor(seeds), torch.tensor(positions), 20)
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        for tok in range(20):
            h = murmur3_32(struct.pack("<4I", seed & 0xFFFFFFFF, seed >> 32, pos, tok))
            u = ((h >> 9) + 0.5) * 2.0**-23
            assert got[i, tok].item() == pytest.approx(-torch.tensor(u).log().item(), rel=1e-6)
    assert bool((got > 0).all())


def support(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> set[int]:
    logits = logits_row.expand(n, -1).clone()
    return set(sample(logits, [params] * n, seed=5))


def test_top_k_support():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6))
    expected = set(logits.topk(3).indices.tolist())
    assert support(logits, SamplingParams(top_k=3, temperature=3.0)) == expected
    assert support(logits, SamplingParams(top_k=1)) == {int(logits.argmax())}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_support(top_p, expected):
    assert support(PROBS5.log(), SamplingParams(top_p=top_p)) == expected


def test_top_p_keeps_tokens_tied_with_the_cut():
    # The mass before the tied pair's first token is 0.5 < 0.6, before its second 0.7: the
    # second stays too, whichever of the two the sort put first (the GPU kernel's rule).
    assert support(torch.tensor([0.5, 0.2, 0.2, 0.1]).log(), SamplingParams(top_p=0.6)) == {0, 1, 2}


@pytest.mark.parametrize(("min_p", "expected"), [(0.15, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_support(min_p, expected):
    assert support(PROBS5.log(), SamplingParams(min_p=min_p)) == expected


def test_top_k_then_top_p_on_renormalized_distribution():
    # top_k=3 leaves {0.5, 0.3, 0.1} / 0.9 = {.556, .333, .111}; top_p=0.85 then keeps 2.
    assert support(PROBS5.log(), SamplingParams(top_k=3, top_p=0.85)) == {0, 1}


def test_truncation_rows_do_not_leak_into_each_other():
    logits = PROBS5.log().expand(4, 5).clone()
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.4),
              SamplingParams(min_p=0.9)]
    probs = sampling_probs(logits, meta_for(params, 5))
    assert torch.allclose(probs[1], PROBS5)
    for i in (0, 2, 3):
        assert torch.allclose(probs[i], torch.tensor([1.0, 0, 0, 0, 0]))


def test_temperature_scaling():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8))
    temps = [0.5, 1.0, 2.5]
    probs = sampling_probs(logits, meta_for([SamplingParams(temperature=t) for t in temps]))
    for i, t in enumerate(temps):
        assert torch.allclose(probs[i], (logits[i] / t).softmax(-1), atol=1e-6)


def test_temperature_changes_sampled_frequencies():
    n = 20_000
    logits = PROBS5.log().expand(n, 5).clone()
    for t in (0.5, 2.0):
        expected = (PROBS5.log() / t).softmax(-1)
        tokens = sample(logits, [SamplingParams(temperature=t)] * n, seed=9)
        assert chi_square(tokens, expected) < CHI2_BOUND_DF4


def test_penalties_and_bias_follow_formulas():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(10)) * 3
    prompts = [[1, 2, 2, 3], [4, 5], [6]]
    outputs = [[3, 7, 7, 7], [5, 8, 8], []]
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={9: 2.0, 1: -1.5}),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),  # prompt not penalized
        SamplingParams(logit_bias={6: 100.0}),
    ]
    got = process_logits(logits, meta_for(params, prompts=prompts, outputs=outputs))

    want = logits.clone()
    for i, p in enumerate(params):
        for tok, b in p.logit_bias.items():
            want[i, tok] += b
        for tok in set(prompts[i]) | set(outputs[i]):
            if p.repetition_penalty != 1.0:
                x = want[i, tok]
                want[i, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[i]):
            c = outputs[i].count(tok)
            want[i, tok] -= p.presence_penalty + p.frequency_penalty * c
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, logits)  # the penalties did something


def test_repetition_penalty_signs():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    meta = meta_for([SamplingParams(repetition_penalty=2.0)], 4, prompts=[[0, 1]], outputs=[[]])
    assert process_logits(logits, meta).tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_logit_bias_key_outside_vocab_is_rejected():
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        meta_for([SamplingParams(logit_bias={VOCAB: 1.0})])


def test_logprobs_from_raw_logits():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(logprobs=5, temperature=0.7, logit_bias={3: 4.0}),
              SamplingParams(logprobs=0),
              SamplingParams(),
              SamplingParams(logprobs=2, temperature=0.0)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta_for(params))
    logp = logits.log_softmax(-1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for i, n in ((0, 5), (1, 0), (3, 2)):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(logp[i, lp.token_id].item(), abs=1e-6)
        top = logp[i].topk(n) if n else None
        assert [t for t, _ in lp.top] == (top.indices.tolist() if n else [])
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist() if n else [])


def test_logprobs_more_than_vocab():
    logits = torch.randn(1, 5)
    out = Sampler()(logits, meta_for([SamplingParams(logprobs=20)], 5))
    assert [t for t, _ in out.logprobs[0].top] == logits[0].argsort(descending=True).tolist()


def test_no_logprobs_requested():
    out = Sampler()(torch.randn(2, VOCAB), meta_for([SamplingParams()] * 2))
    assert out.logprobs is None and len(out.token_ids) == 2


def test_metadata_flags_skip_unused_stages():
    meta = meta_for([SamplingParams(temperature=0.0, top_k=5, seed=1)] * 2)
    assert meta.all_greedy and not meta.any_truncation and not meta.any_seeded
    assert not meta.any_penalty and not meta.any_bias and meta.max_logprobs is None
    meta = meta_for([SamplingParams(top_k=VOCAB), SamplingParams(top_k=-1, logprobs=3)])
    assert meta.top_k_rows is None and not meta.any_truncation and meta.max_logprobs == 3


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 200.0}}, "logit_bias"),
    ],
)
def test_params_validation_names_parameter(kwargs, name):
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(**kwargs)
