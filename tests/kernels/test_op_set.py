"""The op set contract (kernels/op_set.py): every backend implements every method with the
contract's parameters, `kernels.get_ops` hands out contract objects, the engine asks no
backend what it can do, and each backend's step-level entry points (a step's decodes and
prefill chunks; a step's sampled rows) give the same answers on the same inputs.

The Triton backend runs in Triton's interpreter on CPU (small shapes)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and so triton) are first imported

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

import kernels
from common.sampling_params import SamplingParams
from engine.sampler import RowDraw, SamplingMetadata, process_logits
from kernels.attention_step import AttentionMetadata, PrefillSpan, StepDecodes
from kernels.native_ops import NativeOps
from kernels.op_set import OpSet
from kernels.reference import TorchOps
from kernels.triton_ops import TritonOps

REPO = Path(__file__).resolve().parents[2]
BACKENDS = {"torch": TorchOps, "native": NativeOps, "triton": TritonOps}
CONTRACT = sorted(OpSet.__abstractmethods__)


def _params(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_implements_every_method_of_the_contract(name):
    cls = BACKENDS[name]
    assert issubclass(cls, OpSet)
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    assert cls.name == name
    ops = cls()
    assert len(CONTRACT) >= 14  # the row-wise, pool, attention, step and matmul methods
    for method in CONTRACT:
        want, got = _params(getattr(OpSet, method)), _params(getattr(ops, method))
        assert [p.name for p in got[:len(want)]] == [p.name for p in want], f"{name}.{method}"
        extra = [p.name for p in got[len(want):] if p.default is inspect.Parameter.empty]
        assert not extra, f"{name}.{method} requires {extra}, which the contract does not pass"


@pytest.mark.parametrize("choice", ["torch", "native", "triton"])
def test_get_ops_hands_out_the_chosen_backend_as_an_op_set(choice, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", choice)
    ops = kernels.get_ops("cpu")
    assert isinstance(ops, BACKENDS[choice]) and ops.name == choice
    assert kernels.get_ops("cpu") is ops  # one object per backend: a step asks every layer


FLAGS = {"BATCHED", "DECODE_IN_PLACE", "PREFILL_IN_PLACE", "NAME"}


def test_the_engine_asks_no_backend_what_it_can_do():
    """No getattr / hasattr on an op set and no capability flag anywhere in engine/."""
    wrong = []
    for path in sorted((REPO / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in ("getattr", "hasattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if target == "ops" or target.endswith(".ops"):
                    wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


H, KVH, D, BS = 4, 2, 64, 8  # head_dim 64: the native prefill kernel serves it


def _naive(q, k, v, scale):  # q [n, H, D], k/v [ctx, KVH, D]; causal, q = the last n positions
    n, ctx = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


def _mixed_step(g: torch.Generator):
    """Decodes of mixed context lengths (one far longer: the torch ops split it off) and two
    prefill chunks, one over a cached prefix: (contexts, decodes, spans, k, v, pool)."""
    decode_lens, prefills = [3, 9, 9, 17, 120], [(6, 6), (5, 21)]  # (new tokens, context)
    contexts = decode_lens + [ctx for _, ctx in prefills]
    perm = torch.randperm(64, generator=g).tolist()
    tables = [[perm.pop() for _ in range(math.ceil(c / BS))] for c in contexts]
    k_cache, v_cache = (torch.randn(64, BS, KVH, D, generator=g) for _ in range(2))
    news = [1] * len(decode_lens) + [n for n, _ in prefills]
    tokens = sum(news)
    k, v = torch.randn(tokens, KVH, D, generator=g), torch.randn(tokens, KVH, D, generator=g)
    slots, spans, start = [], [], 0
    for i, (ctx, new) in enumerate(zip(contexts, news)):
        slots += [(tables[i][p // BS], p % BS) for p in range(ctx - new, ctx)]
        if new > 1:
            spans.append(PrefillSpan(start, new, ctx, torch.tensor(tables[i])))
        start += new
    nd, width = len(decode_lens), max(len(t) for t in tables)
    padded = torch.tensor([t + [perm[0]] * (width - len(t)) for t in tables[:nd]])  # stale ids past a table
    decodes = StepDecodes(padded, torch.tensor(decode_lens), decode_lens, [len(t) for t in tables[:nd]], BS)
    slot_blocks = torch.tensor([b for b, _ in slots])
    slot_offsets = torch.tensor([o for _, o in slots])
    return contexts, tables, news, decodes, spans, k, v, k_cache, v_cache, slot_blocks, slot_offsets


@pytest.mark.parametrize("choice", ["torch", "native", "triton"])
def test_attention_step_over_decodes_and_prefill_chunks_matches_naive_attention(choice, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", choice)
    ops = kernels.get_ops("cpu")
    g = torch.Generator().manual_seed(7)
    contexts, tables, news, decodes, spans, k, v, k_cache, v_cache, blocks, offsets = _mixed_step(g)
    groups = ops.plan_decodes(decodes, "cpu")
    assert [(x.start, x.end) for x in groups][0][0] == 0 and groups[-1].end == len(decodes)
    assert all(a.end == b.start for a, b in zip(groups, groups[1:]))
    if choice == "torch":  # gathered and padded: the one long context goes in a group of its own
        assert len(groups) > 1 and all(x.mask is not None for x in groups)
    q = torch.randn(k.shape[0], H, D, generator=g)
    meta = AttentionMetadata(blocks, offsets, groups, spans)
    scale = D**-0.5
    out = ops.attention_step(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape
    start = 0
    for ctx, table, new in zip(contexts, tables, news):
        kc, vc = k_cache[table].flatten(0, 1)[:ctx], v_cache[table].flatten(0, 1)[:ctx]
        torch.testing.assert_close(kc[ctx - new:], k[start:start + new])  # written into its slots first
        torch.testing.assert_close(out[start:start + new], _naive(q[start:start + new], kc, vc, scale),
                                   atol=2e-5, rtol=2e-5)
        start += new


def test_every_backend_samples_a_seeded_row_alike_through_sample_step(monkeypatch):
    """Torch and native draw by the engine's torch stages, Triton by its kernel from dense
    parameters: a seeded row's token is the same (the same hashed draws), greedy rows aside."""
    g = torch.Generator().manual_seed(11)
    vocab = 200
    params = [SamplingParams(temperature=0.8, top_k=40, seed=5), SamplingParams(temperature=1.2, top_p=0.7, seed=6),
              SamplingParams(temperature=0.6, min_p=0.05, seed=7)]
    meta = SamplingMetadata.build(params, [[1, 2]] * 3, [[3], [], [4, 5]], vocab, "cpu")
    processed = process_logits(torch.randn(3, vocab, generator=g) * 3, meta)
    tokens = {}
    for choice in BACKENDS:
        monkeypatch.setenv("PDSERVE_KERNELS", choice)
        tokens[choice] = kernels.get_ops("cpu").sample_step(processed, RowDraw(meta, None)).tolist()
    assert tokens["native"] == tokens["torch"] == tokens["triton"], tokens
