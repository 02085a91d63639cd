"""A conversation's next turn on a prefill and a decode worker: the decode worker holds the
first turn's prompt and its answer cached (it decoded the answer), the prefill worker only
the prompt (it computed it). The second turn's prompt is both plus a new message; the
decode worker's remote prefill names itself as the KV holder (PrefillRequest.kv_holder),
and the prefill worker fetches the answer's blocks from it over NIXL instead of computing
them (worker/prefix_fetch.py): it computes only the new message, and the tokens are those
the decode worker gives computing the turn itself. Real processes, real NIXL."""

from __future__ import annotations

import random

import pytest

from bench.harness.worker_procs import WorkerProc, start_workers
from rpc import pdserve_pb2 as pb
from tests.gateway.test_prefix_routing import _sample
from tests.worker.grpc_calls import RPC_TIMEOUT_S, assert_idle, generate_request, random_prompt

ARGS = ["--dtype", "float32", "--kv-blocks", "256"]
BS = 16


@pytest.fixture(scope="module")
def pair(smollm2_dir, tmp_path_factory):
    p, d = start_workers([("prefill", ARGS, {}), ("decode", ARGS, {})], smollm2_dir,
                         tmp_path_factory.mktemp("prefill-fetch"), timeout_s=120)
    yield p, d
    p.stop()
    d.stop()


def _run(d: WorkerProc, prompt: list[int], prefill: list[str], max_tokens: int) -> tuple[list[int], pb.Served]:
    req = generate_request(prompt, max_tokens, prefill, logit_bias={2: -100.0, 0: -100.0})
    tokens, served = [], None
    for msg in d.stub.Generate(req, timeout=RPC_TIMEOUT_S):
        assert msg.error.code == pb.ERROR_NONE, msg.error
        if msg.HasField("served"):
            served = msg.served
        tokens.extend(msg.token_ids)
    return tokens, served


def _metric(w: WorkerProc, name: str, **labels: str) -> float:
    text = w.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition.decode()
    if labels:
        return _sample(text, name, **labels) or 0.0
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def test_the_prefill_worker_fetches_the_answer_the_decode_worker_holds_and_computes_the_new_message(pair):
    p, d = pair
    rng = random.Random(11)
    first = random_prompt(rng, 3 * BS)
    answer, served = _run(d, first, [p.address], 40)
    assert served.prefill_worker == p.address  # turn 1: the prefill worker computed the prompt
    turn2 = first + answer + random_prompt(rng, 20)
    d_holds = (len(first) + len(answer) - 1) // BS  # full blocks the decode worker cached (its last token's KV is not)
    assert d_holds > len(first) // BS  # ... more than the prefill worker holds: the answer's blocks

    hits, computed = (_metric(p, "pdserve_engine_prefix_cache_hit_tokens_total"),
                      _metric(p, "pdserve_engine_prompt_tokens_total"))
    tokens, served = _run(d, turn2, [p.address], 8)
    assert served.prefill_worker == p.address and served.cached_prompt_tokens >= d_holds * BS
    fetched = _metric(p, "pdserve_engine_prefix_tier_tokens_total", tier="sibling")
    assert fetched >= (d_holds - len(first) // BS) * BS  # the answer's blocks came from the decode worker
    assert _metric(p, "pdserve_prefix_fetches_total", outcome="fetched") >= 1
    assert _metric(d, "pdserve_prefix_served_blocks_total") >= d_holds - len(first) // BS
    new_hits = _metric(p, "pdserve_engine_prefix_cache_hit_tokens_total") - hits
    new_prompt = _metric(p, "pdserve_engine_prompt_tokens_total") - computed
    assert new_prompt - new_hits <= len(turn2) - d_holds * BS  # only the tail past the decode worker's blocks

    want, _ = _run(d, turn2, [], 8)  # the decode worker computing the turn itself, from its own cache
    assert tokens == want
    assert_idle(p, d)
