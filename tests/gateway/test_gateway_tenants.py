"""API keys and tenants: refused before the body is read, limits per tenant given back on
every path, prefix caches kept apart; a tenant with no max_concurrent of its own (the open
gateway's) runs what the decode pool holds, and what that pool's streams send while the
gateway is paused reaches it whole."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.gateway_procs import CHAT, gateway, metric_value, raw_post
from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO, start_workers, wait_idle, wait_until
from gateway.errors import APIError
from gateway.routing.router import Router
from gateway.tenants import STARTUP_SEQUENCES, Tenant, Tenants
from rpc import pdserve_pb2 as pb


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(tenant_gateway):
    """With API keys, a POST to the API gets 401 from its headers alone: a client that never
    finishes its body (or sends a huge one) gets its answer all the same."""
    for head in ({}, {"authorization": "Bearer nope"}):
        answer = raw_post(tenant_gateway, head, [b'{"model": "smollm2", '], finish=False)
        assert answer.startswith(b"HTTP/1.1 401"), (head, answer[:200])
        assert b"invalid_api_key" in answer
    ok = raw_post(tenant_gateway, {"authorization": "Bearer key-b"},
                   [b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2}'], finish=True)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_tokenize_and_detokenize_take_a_tenants_key_like_the_api(tenant_gateway):
    for path, body in (("/tokenize", {"model": "smollm2", "prompt": "Hi"}),
                       ("/detokenize", {"model": "smollm2", "tokens": [1, 2]})):
        assert httpx.post(f"{tenant_gateway}{path}", json=body).status_code == 401
        ok = httpx.post(f"{tenant_gateway}{path}", json=body, headers={"authorization": "Bearer key-b"})
        assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def tenant_gateway(system, smollm2_dir, tmp_path_factory):
    """A second gateway over the same workers, with API keys: tenant a (1 request at a time), b."""
    _, prefill, decode = system
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "a", "api_keys": ["key-a"], "max_concurrent": 1},
        {"name": "b", "api_keys": ["key-b"], "max_concurrent": 4, "priority": 1},
        {"name": "c", "api_keys": ["key-c"], "max_concurrent": 4, "share_prefix_cache": True},
    ]}))
    with gateway(smollm2_dir, [decode.address], [prefill.address], folder / "gateway.log",
                 "--tenants", str(folder / "tenants.json")) as url:
        yield url
    assert b"key-a" not in (folder / "gateway.log").read_bytes()  # keys are never logged


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_its_first_byte_gives_back_its_tenant_slot(tenant_gateway, stream):
    """Tenant a may have 1 request at a time. A client of a's that sends a request and hangs
    up at once (before any byte of the answer) must not keep that slot: a's next requests
    are served, not refused 429 for good."""
    url = tenant_gateway
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 64,
                       "stream": stream}).encode()
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer key-a\r\n"
                       f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body)
        time.sleep(0.3)

    def served() -> bool:
        r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"authorization": "Bearer key-a"},
                       json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code in (200, 429), r.text
        return r.status_code == 200

    deadline = time.monotonic() + 60  # a bound for the abandoned requests to unwind, not a speed
    while not served():
        assert time.monotonic() < deadline, "tenant a's slot was never given back"
        time.sleep(0.5)


def _cached_tokens(url: str, key: str, prompt: str, **extra) -> int:
    """The prompt's cached tokens as tenant `key` sees them (one token generated)."""
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                   json={"model": "smollm2", "prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_one_tenants_prefix_cache_is_invisible_to_another(tenant_gateway):
    """Tenant a's prompt is cached for a (its second send reports cached tokens), but tenant
    b sending the very same prompt finds nothing: b cannot probe what a's prompts began with.
    A client's own cache_salt splits its tenant's cache further."""
    prompt = "The lighthouse keeper counted the ships that passed in the night. " * 6  # several full blocks

    def cached(key: str, **extra) -> int:
        return _cached_tokens(tenant_gateway, key, prompt, **extra)

    cached("key-a")
    assert cached("key-a") > 0  # a hits its own cache
    assert cached("key-b") == 0  # the same prompt, another tenant: no hit
    assert cached("key-b") > 0  # b's own send is now cached for b
    assert cached("key-a", cache_salt="session-1") == 0  # a's client split its cache


def test_a_tenant_sharing_its_cache_cannot_spell_another_tenants_salt(tenant_gateway):
    """Tenant c shares the prefix cache; its client sending the salt a's requests used to get
    ("tenant:a") must not find a's entries."""
    prompt = "The cartographer drew the coastline of an island nobody else had seen. " * 6

    def cached(key: str, **extra) -> int:
        return _cached_tokens(tenant_gateway, key, prompt, **extra)

    cached("key-a")
    assert cached("key-a") > 0
    for salt in ("tenant:a", "tenant6:a;", "tenant1:a;"):
        assert cached("key-c", cache_salt=salt) == 0, salt


def test_the_workers_know_a_request_by_its_tenant_whatever_salt_its_client_sends(system, tenant_gateway):
    """What a worker shares between requests (grammar compiles) takes turns by tenant: the
    decode worker must see the tenant's name, not the cache salt, which a client could vary
    per request to count as many tenants."""
    decode = system[2]
    marks = []
    for salt in ("one", "two"):
        r = httpx.post(f"{tenant_gateway}/v1/completions", timeout=60, headers={"authorization": "Bearer key-c"},
                       json={"model": "smollm2", "prompt": f"Salted {salt}", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200, r.text
        marks.append(r.json()["id"])
    arrived = [json.loads(line[line.index("{"):]) for line in decode.log_path.read_text().splitlines()
               if '"event":"arrived"' in line and any(m in line for m in marks)]
    assert len(arrived) == 2 and {a.get("tenant") for a in arrived} == {"c"}, arrived


def test_no_client_salt_or_tenant_name_spells_another_tenants_salt():
    isolated, shared = Tenant("a"), Tenant("c", share_prefix_cache=True)
    salts = {
        isolated.cache_salt(None), isolated.cache_salt("x"), Tenant("a/x").cache_salt(None),
        Tenant("a;client1:x").cache_salt(None), shared.cache_salt(None),
        *(shared.cache_salt(s) for s in ("tenant:a", "tenant:a/x", isolated.cache_salt(None),
                                         isolated.cache_salt("x"), "a", "x")),
    }
    assert len(salts) == 11  # every one distinct
    assert shared.cache_salt(None) == "" and Tenant("c", share_prefix_cache=True).cache_salt("s") == shared.cache_salt("s")


def test_each_choice_counts_against_the_tenants_concurrency(tenant_gateway):
    """Tenant a may run 1 sequence: n = 2 can never run (400, naming n); tenant b may run 4:
    with an n = 3 stream open, an n = 2 request is refused (429) and an n = 1 one is served."""
    url = tenant_gateway
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    never = httpx.post(f"{url}/v1/completions", timeout=30, headers={"authorization": "Bearer key-a"},
                       json={**body, "n": 2})
    assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text
    hold = {**body, "n": 3, "max_tokens": 300, "stream": True, "logit_bias": {"2": -100}}
    with httpx.stream("POST", f"{url}/v1/completions", json=hold, timeout=60,
                      headers={"authorization": "Bearer key-b"}) as first:
        lines = first.iter_lines()
        assert "error" not in next(line for line in lines if line.startswith("data: "))
        two = httpx.post(f"{url}/v1/completions", timeout=30, headers={"authorization": "Bearer key-b"},
                         json={**body, "n": 2})
        assert two.status_code == 429, two.text
        one = httpx.post(f"{url}/v1/completions", timeout=60, headers={"authorization": "Bearer key-b"}, json=body)
        assert one.status_code == 200, one.text


def test_api_keys_and_tenant_isolation(tenant_gateway):
    url = tenant_gateway
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    hold = {**body, "max_tokens": 300, "stream": True, "logit_bias": {"2": -100}}  # no EOS: it runs long
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=hold, timeout=60,
                      headers={"authorization": "Bearer key-a"}) as first:
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        first_line = next(line for line in lines if line.startswith("data: "))  # a at its limit
        assert "error" not in json.loads(first_line[6:]), first_line
        again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                           headers={"authorization": "Bearer key-a"})
        assert again.status_code == 429 and again.headers["retry-after"] == "1"
        assert "1 concurrent sequences" in again.json()["error"]["message"]
        assert "max_concurrent in the tenants file" in again.json()["error"]["message"], again.text
        refused = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                   if line.startswith('pdserve_rejections_total{reason="tenant_concurrency"}')]
        assert refused and float(refused[0].split()[-1]) >= 1, refused
        other = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": "Bearer key-b"})
        assert other.status_code == 200  # tenant b is not held back by a
    after = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, headers={"authorization": "Bearer key-a"})
    assert after.status_code == 200  # a's slot came back when its stream closed


def test_a_tenant_without_max_concurrent_runs_what_the_healthy_decode_pool_holds(tmp_path):
    """The open tenant, and a tenants-file entry with no max_concurrent, may run the pool's
    max_num_seqs + max_waiting summed over the healthy decode workers (a fixed start-up
    limit before any reported); an entry's own max_concurrent stays what it says. Past the
    limit a 429 names the number and where it comes from."""
    router = Router(["d0", "d1", "d2"], ["p0"])
    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "capped", "api_keys": ["k1"], "max_concurrent": 3},
        {"name": "pooled", "api_keys": ["k2"]},
    ]}))
    open_tenants, keyed = Tenants(), Tenants.from_file(tmp_path / "tenants.json")
    for tenants in (open_tenants, keyed):
        tenants.follow_pool(router.decode_pool_size)
    anonymous, capped, pooled = open_tenants.anonymous, keyed.by_key["k1"], keyed.by_key["k2"]
    assert anonymous.concurrency_limit()[0] == pooled.concurrency_limit()[0] == STARTUP_SEQUENCES
    router.decode[0].observe(100, 100, 16, 0, max_sequences=128 + 8)
    router.decode[1].observe(100, 100, 16, 0, max_sequences=32 + 4)
    router.prefill[0].observe(100, 100, 16, 0, max_sequences=1000)  # prefill workers hold no sequence of a tenant
    assert anonymous.concurrency_limit()[0] == pooled.concurrency_limit()[0] == 136 + 36  # d2 has not reported
    assert capped.concurrency_limit() == (3, "its max_concurrent in the tenants file")

    anonymous.admit(100, choices=170)
    anonymous.admit(100, choices=2)  # at the limit: 172
    with pytest.raises(APIError) as refused:
        anonymous.admit(100)
    e = refused.value
    assert (e.status, e.code, e.reason) == (429, "tenant_concurrency_limit", "tenant_concurrency")
    assert "172 concurrent sequences" in e.message and "max_num_seqs + max_waiting of its 2 decode workers" in e.message
    router.decode[1].healthy = False  # failing deep health: routing skips it, and so does the limit
    assert anonymous.concurrency_limit()[0] == 136
    anonymous.release(200, choices=172)
    anonymous.admit(100, choices=136)
    with pytest.raises(APIError, match="136 concurrent sequences"):
        anonymous.check_concurrency(1)
    with pytest.raises(APIError) as never:
        pooled.check_concurrency(137)  # n above what the pool holds: 400, naming n
    assert never.value.status == 400 and never.value.param == "n" and "136" in never.value.message
    capped.admit(10, choices=3)
    with pytest.raises(APIError, match="3 concurrent sequences"):
        capped.admit(10)


# The pool of the tests below: one decode worker (a tiny random model, prefilling locally)
# that holds 128 running and 128 queued sequences, behind an open gateway. Every request
# arrives in the worker's queue, so a burst larger than the queue, all within one engine
# step, meets the worker's own "queue is full": the bursts here are no larger.
MAX_NUM_SEQS, MAX_WAITING = 128, 128
POOL = MAX_NUM_SEQS + MAX_WAITING
NO_EOS = {"0": -100, "2": -100}  # the end-of-text ids of the tokenizer (SmolLM2's) and of the tiny config
ONE_MORE = {"model": "smollm2", "prompt": [5, 6, 7, 8], "max_tokens": 4}
# The gateway is paused (SIGSTOP) in a test below for as long as the worker takes to finish
# its streams: pings it cannot answer must not end the call meanwhile.
PAUSABLE = {"PDSERVE_PEER_SILENCE_S": "600"}
LONG = 2500  # tokens of the streams that fill a paused gateway's backlog (KV: 20,500 blocks of 16 hold 128)
MAX_POSITIONS = LONG + 8  # the prompt (4 tokens) and the last token


@pytest.fixture(scope="module")
def roomy_pool(smollm2_dir, tmp_path_factory):
    """(gateway URL, decode worker): an open gateway over a decode worker with room for
    more than 64 sequences, ready (it has read the worker's Stats)."""
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", max_positions=MAX_POSITIONS)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway tokenizes; prompts here are ids < 320
        shutil.copy(smollm2_dir / name, model / name)
    logs = tmp_path_factory.mktemp("roomy-logs")
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "20500", "--no-transfer",
                                           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING)],
                                PAUSABLE)], model, logs)
    started: list[subprocess.Popen] = []
    try:
        with gateway(model, [decode.address], [], logs / "gateway.log", "--request-timeout", "600",
                     started=started, env=PAUSABLE) as url:
            assert httpx.get(f"{url}/ready", timeout=60).json() == {"ready": True}  # a Stats round: the pool's size
            yield url, decode, started[0]
    finally:
        decode.stop()


def _stream_body(max_tokens: int) -> dict:
    return {"model": "smollm2", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}


async def _read_stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, int | None, bool]:
    """(status, completion tokens of its usage chunk, whether [DONE] came)."""
    usage, done = None, False
    async with http.stream("POST", f"{url}/v1/completions", json=_stream_body(max_tokens)) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and (chunk := json.loads(line[6:])).get("usage"):
                usage = chunk["usage"]["completion_tokens"]
        return r.status_code, usage, done


def test_the_open_gateway_runs_more_than_64_streams_when_the_decode_pool_holds_them(roomy_pool):
    """100 streams at once on a decode worker that runs 128: more than 64 run together (none
    refused by a tenant limit of 64) and every one completes. How many were seen running at
    once is polled, not timed: on a loaded host the first may end before the last arrives."""
    url, decode, _ = roomy_pool
    streams, max_tokens = 100, 256

    async def burst() -> tuple[int, list]:
        most = 0
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=2 * POOL)) as http:
            tasks = [asyncio.create_task(_read_stream(http, url, max_tokens)) for _ in range(streams)]

            def all_running_or_one_ended() -> bool:  # a refused or finished stream ends the wait at once
                nonlocal most
                running = decode.stats().running_requests
                most = max(most, running)
                return running == streams or any(t.done() for t in tasks)

            await asyncio.to_thread(wait_until, all_running_or_one_ended, 120, f"{streams} streams on the worker")
            return most, await asyncio.gather(*tasks)

    most, answers = asyncio.run(burst())
    assert answers == [(200, max_tokens, True)] * streams, [a for a in answers if a != (200, max_tokens, True)][:5]
    assert most > 64, most  # more than a 64-sequence tenant limit would let run, on the worker at once
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(metrics, "pdserve_rejections_total", reason="tenant_concurrency") == 0
    s = wait_idle(decode)
    assert s.running_requests == s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s


def test_past_what_the_decode_pool_holds_the_open_tenant_gets_a_429_naming_it(roomy_pool):
    """With the pool full (128 running, then 128 queued on its one worker), one more stream
    gets a 429 from the gateway that says the limit and where it comes from; once they end,
    the tenant's slots are back."""
    url, decode, _ = roomy_pool

    def worker_holds(running: int, waiting: int) -> None:  # a bound on the wait, not a speed
        def holds() -> bool:
            s = decode.stats()
            return (s.running_requests, s.waiting_requests) == (running, waiting)

        wait_until(holds, 120, f"{running} running and {waiting} queued on the worker")

    async def full_then_one_more() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=2 * POOL)) as http:
            held = []
            try:
                # two waves, each no larger than the queue: the running sequences, then the queued ones
                waves = ((MAX_NUM_SEQS, MAX_NUM_SEQS, 0), (MAX_WAITING, MAX_NUM_SEQS, MAX_WAITING))
                for wave, running, waiting in waves:
                    # long streams (cancelled below): none ends while the waves arrive, however slow the host
                    held += [asyncio.create_task(_read_stream(http, url, LONG)) for _ in range(wave)]
                    await asyncio.to_thread(worker_holds, running, waiting)
                return await http.post(f"{url}/v1/completions", json=ONE_MORE)
            finally:
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)

    refused = asyncio.run(full_then_one_more())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    error = refused.json()["error"]
    assert error["code"] == "tenant_concurrency_limit", error
    assert f"tenant anonymous: {POOL} concurrent sequences" in error["message"], error
    assert "max_num_seqs + max_waiting of its 1 decode worker" in error["message"], error
    s = wait_idle(decode, timeout_s=60)
    assert s.running_requests == s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s
    served = httpx.post(f"{url}/v1/completions", timeout=60, json=ONE_MORE)
    assert served.status_code == 200, served.text


def _worker_counts(decode) -> tuple[int, int, float]:
    """(messages sent on gateways' Streams calls, those of them over gRPC's default 4 MiB,
    tokens the engine computed), from the decode worker's own registry."""
    text = decode.stub.Metrics(pb.MetricsRequest(), timeout=30).exposition.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    sizes = families["pdserve_streams_down_bytes"].samples
    count = next(s.value for s in sizes if s.name.endswith("_count"))
    within = next(s.value for s in sizes if s.name.endswith("_bucket") and float(s.labels["le"]) == 4 << 20)
    tokens = sum(s.value for s in families["pdserve_engine_step_tokens"].samples if s.name.endswith("_sum"))
    return int(count), int(count - within), tokens


# While the gateway is paused, the worker's Streams call sends until the connection's buffers
# and gRPC's flow-control windows are full (a few MiB, more as the window grows), then blocks;
# what the engine makes from then on merges into the next message. Tokens with 5 alternatives
# take ~52 bytes each in it (measured with this model): at 45 a token, this many make it past 4 MiB.
PAST_4_MIB_TOKENS = (4 << 20) // 45


def test_what_a_paused_gateway_could_not_read_reaches_it_whole_past_4_mib(roomy_pool):
    """127 streams with 5 alternatives a token and one plain one, the gateway paused (SIGSTOP)
    until its backlog on the worker (made once the connection could take no more) is past
    gRPC's default 4 MiB; then the 127 leave and the gateway resumes. The merged message
    crosses whole (rpc/auth.py MAX_MESSAGE_BYTES on the gateway's channel) and the plain
    stream, which was in it, is served whole, on the same call: none retried."""
    url, decode, gateway_process = roomy_pool
    _, big_before, _ = _worker_counts(decode)
    filler = {**_stream_body(LONG), "logprobs": 5}

    async def witness(http: httpx.AsyncClient) -> tuple[int, int | None, bool]:
        return await _read_stream(http, url, LONG)

    async def fill(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", f"{url}/v1/completions", json=filler) as r:
            async for _ in r.aiter_bytes():
                pass

    def backlog_past_4_mib() -> bool:
        """Poll the worker: true once the tokens made since its last message was taken are
        past PAST_4_MIB_TOKENS (or it has nothing left running, which fails below)."""
        last_count, since = -1, 0.0
        while True:
            count, _, tokens = _worker_counts(decode)
            if count != last_count:
                last_count, since = count, tokens
            if tokens - since >= PAST_4_MIB_TOKENS:
                return True
            if decode.stats().running_requests < MAX_NUM_SEQS:
                return False  # a stream ended: LONG was too short for this host's windows
            time.sleep(0.2)

    async def paused_midway() -> tuple[bool, tuple]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * POOL)) as http:
            kept = asyncio.create_task(witness(http))
            fillers = [asyncio.create_task(fill(http)) for _ in range(MAX_NUM_SEQS - 1)]
            await asyncio.to_thread(wait_until, lambda: decode.stats().running_requests == MAX_NUM_SEQS
                                    or kept.done(), 120, f"{MAX_NUM_SEQS} streams on the worker")
            os.kill(gateway_process.pid, signal.SIGSTOP)
            try:
                filled = await asyncio.to_thread(backlog_past_4_mib)
                for t in fillers:  # they leave while the gateway is paused: it renders none of their backlog
                    t.cancel()
                await asyncio.gather(*fillers, return_exceptions=True)
            finally:
                os.kill(gateway_process.pid, signal.SIGCONT)
            return filled, await kept

    filled, answer = asyncio.run(paused_midway())
    assert filled, f"every stream ended before the backlog passed 4 MiB: raise LONG ({LONG})"
    assert answer == (200, LONG, True), answer  # the plain stream, served whole on the same call
    _, big_after, _ = _worker_counts(decode)
    assert big_after > big_before  # the merged message past gRPC's default crossed, and was taken
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for when in ("before_first_token", "mid_stream", "handed_off"):
        assert metric_value(metrics, "pdserve_decode_retries_total", when=when) == 0, when
    s = wait_idle(decode, timeout_s=60)  # the streams that left are cancelled there, their KV freed
    assert s.running_requests == s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s


def test_two_tenants_named_alike_are_refused_at_start(smollm2_dir, tmp_path):
    """A name is a tenant's cache salt and its stored responses' namespace: a file naming two
    entries alike stops the gateway at start, naming the tenant, before it serves anyone."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "team", "api_keys": ["k1"]},
                                               {"name": "team", "api_keys": ["k2"]}]}))
    with pytest.raises(ValueError, match="'team' is named twice"):
        Tenants.from_file(tenants)
    started = subprocess.run([sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--decode", "127.0.0.1:1",
                              "--tenants", str(tenants), "--port", "0"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 2 and "tenant 'team' is named twice" in started.stderr, started.stderr[-2000:]
