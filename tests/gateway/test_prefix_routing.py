"""Routing on the prefix index, on real workers: `system`'s prefill worker A caches a prompt
(it is the only prefill worker of `system`'s gateway), and a second gateway over A and a
prefill worker B of this file's sends the prompt's continuation to A, though the rendezvous
hash, which routed before the index, picks B for it. The same prompt under another cache
salt is not matched; B's entries go with its incarnation when it restarts at its address."""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import free_port, start_workers
from gateway.routing.router import Router

ARGS = ["--dtype", "float32", "--kv-blocks", "512"]
VOCAB = 49152


@pytest.fixture(scope="module")
def two_prefill(system, smollm2_dir, tmp_path_factory):
    """(first gateway's URL, A, B, the second gateway's URL over A and B, B's flags)."""
    url, a, decode = system
    logs = tmp_path_factory.mktemp("prefix")
    b_args = [*ARGS, "--port", str(free_port()), "--worker-id", "prefix-b"]
    (b,) = start_workers([("prefill", [*b_args, "--incarnation", "1"], {})], smollm2_dir, logs, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [a.address, b.address], logs / "gateway.log") as url2:
            yield url, a, b, url2, (b_args, smollm2_dir, logs)
    finally:
        b.stop()


def _prompt_hashed_to(favourite: str, workers: list[str], seed: int) -> list[int]:
    """A prompt (5 full blocks) whose rendezvous choice among `workers` is `favourite`:
    today's router with an index that knows nothing."""
    rng = random.Random(seed)
    while True:
        prompt = [rng.randrange(1000, VOCAB) for _ in range(80)]
        if Router([], workers).rank_prefill(prompt)[0] == favourite:
            return prompt


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _metrics(url: str) -> str:
    """A scrape, which also runs a Stats round: the index takes the workers' events."""
    return httpx.get(f"{url}/metrics", timeout=30).text


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.match(rf'{name}\{{(.*)\}} (\S+)$', line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_the_index_routes_to_the_worker_holding_the_prefix_not_the_hash(two_prefill):
    url, a, b, url2, _ = two_prefill
    prompt = _prompt_hashed_to(b.address, [a.address, b.address], seed=1)
    _complete(url, prompt)  # A prefills it (and caches its 5 full blocks)
    text = _metrics(url2)
    name_a = a.stats().worker
    assert _sample(text, "pdserve_worker_prefix_index_blocks", worker=name_a) >= 5
    before = _sample(text, "pdserve_prefix_routes_total", pool="prefill", by="index")

    # The continuation: the decode worker holds the prefix too, and asks a prefill worker for the tail.
    r = _complete(url2, prompt + list(range(2000, 2020)))
    assert r.headers["x-pdserve-prefill"] == "remote"
    assert r.headers["x-pdserve-prefill-worker"] == a.name  # rendezvous alone says B
    text = _metrics(url2)
    assert _sample(text, "pdserve_prefix_routes_total", pool="prefill", by="index") == before + 1

    # Under another cache salt the same tokens are another prefix: the index has nothing, the hash decides.
    by_hash = _sample(text, "pdserve_prefix_routes_total", pool="prefill", by="hash")
    _complete(url2, prompt + list(range(2000, 2020)), cache_salt="another")
    text = _metrics(url2)
    assert _sample(text, "pdserve_prefix_routes_total", pool="prefill", by="index") == before + 1
    assert _sample(text, "pdserve_prefix_routes_total", pool="prefill", by="hash") == by_hash + 1


def test_a_restarted_worker_leaves_no_entries(two_prefill):
    url, a, b, url2, (b_args, model, logs) = two_prefill
    prompt = _prompt_hashed_to(b.address, [a.address, b.address], seed=2)
    r = _complete(url2, prompt)
    assert r.headers["x-pdserve-prefill-worker"] == b.name
    old = b.stats().worker
    assert _sample(_metrics(url2), "pdserve_worker_prefix_index_blocks", worker=old) >= 5

    b.stop()  # the same worker again at the same address: a new incarnation, an empty pool
    (b2,) = start_workers([("prefill", [*b_args, "--incarnation", "2"], {})], model, logs, timeout_s=120)
    try:
        new = b2.stats().worker
        assert b2.address == b.address and new != old
        # The gateway's channel may take a reconnect's back-off to reach the new process.
        deadline = time.monotonic() + 30
        while _sample(text := _metrics(url2), "pdserve_worker_prefix_index_blocks", worker=new) is None:
            assert time.monotonic() < deadline, "the new incarnation never answered the gateway's Stats"
            time.sleep(0.2)
        assert _sample(text, "pdserve_worker_prefix_index_blocks", worker=old) is None
        assert _sample(text, "pdserve_worker_prefix_index_blocks", worker=new) == 0
    finally:
        b2.stop()
