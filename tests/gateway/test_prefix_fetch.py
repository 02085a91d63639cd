"""Cross-worker prefix fetch on real workers (worker/prefix_fetch.py): two decode workers of
an aggregated system, A and B. A serves a prompt and caches it; a gateway over both, whose
prefix index knows A's blocks, sends the prompt's continuation to B (A is busy with a long
stream, so B has the least work) naming A as its prefix source: B has A push the prompt's
blocks over NIXL and computes only the tail, and its greedy answer is A's own. The same
continuation under another cache salt finds nothing to fetch: no tenant reads another's
blocks through the index or the fetch."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import WorkerProc, start_workers
from rpc import pdserve_pb2 as pb
from tests.gateway.test_prefix_routing import _metrics, _sample
from tests.worker.grpc_calls import RPC_TIMEOUT_S, assert_idle, generate_request, random_prompt, stalled, wait_logged

ARGS = ["--dtype", "float32", "--kv-blocks", "512"]
VOCAB = 49152
BS = 16


@pytest.fixture(scope="module")
def pair(smollm2_dir, tmp_path_factory):
    """(A, B, the model, the logs folder, A's stall file): A's engine loop freezes while the file exists."""
    logs = tmp_path_factory.mktemp("fetch")
    stall = logs / "stall-a"
    a, b = start_workers([("decode", ARGS, {"PDSERVE_FAULT_STALL_FILE": str(stall)}), ("decode", ARGS, {})],
                         smollm2_dir, logs, timeout_s=120)
    try:
        yield a, b, smollm2_dir, logs, stall
    finally:
        a.stop()
        b.stop()


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _busy(url: str, stop: threading.Event) -> threading.Thread:
    """A long stream on the gateway's least-loaded worker: it counts as thousands of tokens of work there."""
    def run() -> None:
        body = {"model": "smollm2", "prompt": [5, 6, 7, 8], "max_tokens": 3000, "temperature": 0,
                "logit_bias": {"2": -100, "0": -100}, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_prefix_held_by_a_sibling_is_fetched_not_computed(pair):
    a, b, model, logs, _ = pair
    rng = random.Random(3)
    prompt = [rng.randrange(1000, VOCAB) for _ in range(6 * BS)]
    tail = [rng.randrange(1000, VOCAB) for _ in range(20)]
    with gateway(model, [a.address], [], logs / "gateway-a.log") as url_a:
        _complete(url_a, prompt)  # A computes and caches the prompt's blocks
        want = _complete(url_a, prompt + tail).json()["choices"][0]["text"]  # A's own answer, and its blocks
    with gateway(model, [a.address, b.address], [], logs / "gateway-ab.log") as url:
        text = _metrics(url)  # a Stats round: the index takes A's blocks
        name_a, name_b = a.stats().worker, b.stats().worker
        assert _sample(text, "pdserve_worker_prefix_index_blocks", worker=name_a) >= 6
        served_before = _sample(text, "pdserve_prefix_served_blocks_total", worker=name_a) or 0.0
        stop = threading.Event()
        busy = None
        try:
            # The stream goes to A: with no load anywhere, the prefix index's credit decides, and
            # [5, 6, 7, 8] is no one's prefix, so the least outstanding tokens (a tie) pick the first.
            busy = _busy(url, stop)
            for _ in range(100):  # until the stream is running on its worker
                if any(w.stats().running_requests for w in (a, b)):
                    break
                threading.Event().wait(0.1)
            on_a = a.stats().running_requests > 0
            r = _complete(url, prompt + tail)
            got = r.json()
        finally:
            stop.set()
        chosen = r.headers["x-pdserve-decode-worker"]
        holder, taker, taker_name = (a, b, name_b) if on_a else (b, a, name_a)
        assert holder is a, "the long stream was expected on A, the first worker"
        assert chosen == taker_name, "the worker with the least work serves it"
        assert got["choices"][0]["text"] == want  # A's KV, copied exactly, gives A's answer
        # A holds the continuation's 7 full blocks (it answered it); the last token is always computed.
        held = (len(prompt + tail) - 1) // BS
        assert int(r.headers["x-pdserve-cached-tokens"]) == held * BS  # only the tail past them was computed on B
        assert r.headers["x-pdserve-prefix-source"] == name_a  # ... and they came from A
        assert int(r.headers["x-pdserve-prefix-blocks"]) == held
        after = _metrics(url)
        assert _sample(after, "pdserve_engine_prefix_tier_tokens_total", worker=taker_name, tier="sibling") == held * BS
        assert _sample(after, "pdserve_prefix_fetches_total", worker=taker_name, outcome="fetched") == 1
        assert _sample(after, "pdserve_prefix_served_blocks_total", worker=name_a) - served_before == held
        sources = [float(line.split()[1]) for line in after.splitlines()
                   if line.startswith("pdserve_prefix_sources_total ")]
        assert sources and sources[0] >= 1  # the gateway named A as B's source

        # Another tenant's salt: its hashes match nothing of A's, so no source is named and
        # nothing is fetched; B computes the whole prompt.
        r = _complete(url, prompt + tail, cache_salt="another-tenant")
        assert int(r.headers["x-pdserve-cached-tokens"]) == 0
        assert "x-pdserve-prefix-source" not in r.headers
        again = _metrics(url)
        for name in (name_a, name_b):
            assert _sample(again, "pdserve_prefix_fetches_total", worker=name, outcome="fetched") == (
                1 if name == taker_name else 0)
        if busy is not None:
            busy.join(timeout=60)
    assert_idle(a, b)  # no block pinned for the push left behind on either side


def _with_source(prompt: list[int], source: WorkerProc, blocks: int, salt: str) -> pb.GenerateRequest:
    req = generate_request(prompt, 8)
    req.cache_salt = salt
    req.prefix_source.CopyFrom(pb.PrefixSource(address=source.address, blocks=blocks))
    return req


def _tokens(w: WorkerProc, req: pb.GenerateRequest) -> list[int]:
    tokens = []
    for msg in w.stub.Generate(req, timeout=RPC_TIMEOUT_S):
        assert msg.error.code == pb.ERROR_NONE, msg.error
        tokens.extend(msg.token_ids)
    return tokens


def _fetches(w: WorkerProc, outcome: str) -> float:
    return _sample(w.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition.decode(), "pdserve_prefix_fetches_total",
                   outcome=outcome) or 0.0


def test_a_source_that_holds_nothing_under_the_salt_refuses_and_the_prompt_is_computed(pair):
    """A holds the prompt under one tenant's salt; B, told (wrongly) that A holds it under
    another's, asks: A finds none of those blocks and refuses, B computes the prompt, and
    its tokens are those A gives; nothing stays pinned or allocated on either side."""
    a, b, *_ = pair
    prompt = random_prompt(random.Random(5), 5 * BS)
    want = _tokens(a, _with_source(prompt, b, 0, "tenant-x"))  # A computes and caches it under tenant-x's salt
    refused = _fetches(b, "evicted")
    assert _tokens(b, _with_source(prompt, a, 5, "tenant-y")) == want
    assert _fetches(b, "evicted") == refused + 1  # A answered it holds none of them
    assert_idle(a, b)


def test_a_holder_frozen_then_killed_mid_fetch_costs_the_fetch_not_the_request(pair):
    """A's loop is frozen when B's fetch reaches it, and A is killed with kill -9 while B
    waits: B's fetch fails, B waits for proof that A cannot be writing (its next call is
    refused: nothing listens) before it frees the blocks A was to fill, and the request is
    computed on B with the tokens a worker that fetched nothing gives. A is dead afterwards:
    this module's last test."""
    a, b, _, _, stall = pair
    prompt = random_prompt(random.Random(6), 5 * BS)
    want = _tokens(a, _with_source(prompt, b, 0, ""))  # A caches it
    result: dict = {}
    with stalled(stall):
        t = threading.Thread(target=lambda: result.update(tokens=_tokens(b, _with_source(prompt, a, 5, ""))))
        t.start()
        wait_logged(b, "fetching 4 prefix blocks", timeout_s=60)  # the last block holds the token computed
        a.kill()
    t.join(timeout=RPC_TIMEOUT_S)
    assert result.get("tokens") == want
    assert _fetches(b, "failed") >= 1
    assert_idle(b)
