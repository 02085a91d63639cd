"""The gateway in front of real prefill and decode processes (SmolLM2, float32), driven by
the official `openai` client and by raw HTTP for what a client library hides."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from gateway.head_deadline import CLIENT_KEEPALIVE_EXPIRY_S
from rpc import pdserve_pb2 as pb
from tests.worker_procs import REPO, start_workers, wait_idle, wait_until

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# The flood's client expires idle connections before the gateway closes them, as any client
# of it should: one reused just as the gateway's keep-alive ends gets a ReadError.
FLOOD_LIMITS = httpx.Limits(max_connections=100, keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gateway(model_dir, decode: list[str], prefill: list[str], log_path, *extra: str):
    """A `python -m gateway` process over the given workers; yields its URL once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "gateway", "--model", str(model_dir), "--served-name", "smollm2", "--port", str(port)]
    cmd += [a for d in decode for a in ("--decode", d)] + [a for p in prefill for a in ("--prefill", p)]
    gw = subprocess.Popen([*cmd, *extra], cwd=REPO, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gw.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.1)
        yield url
    finally:
        gw.terminate()
        gw.wait(10)


@pytest.fixture(scope="module")
def system(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    args = ["--dtype", "float32", "--kv-blocks", "512"]
    prefill, decode = start_workers([("prefill", args, {}), ("decode", args, {})], smollm2_dir, logs, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [prefill.address], logs / "gateway.log") as url:
            yield url, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def client(system):
    return OpenAI(base_url=f"{system[0]}/v1", api_key="unused", max_retries=0)


def test_models_health_and_ready(system, client):
    url = system[0]
    assert [m.id for m in client.models.list()] == ["smollm2"]
    assert httpx.get(f"{url}/ready", timeout=10).json() == {"ready": True}


def test_a_flood_of_ready_and_metrics_costs_the_workers_one_round_at_a_time(system):
    """/ready and /metrics are open (a load balancer and Prometheus call them without a key),
    so they must not amplify: 300 of each at once, from a cold cache, run a handful of deep
    probes on each worker (the gateway's refresh is shared, its answer cached for the health
    interval), not one each."""
    url, prefill, decode = system
    before = [w.stats().deep_probes for w in (prefill, decode)]

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=60, limits=FLOOD_LIMITS) as http:
            replies = await asyncio.gather(*(http.get(f"{url}/{path}") for _ in range(300)
                                             for path in ("ready", "metrics")))
        return [r.status_code for r in replies]

    codes = asyncio.run(flood())
    assert set(codes) == {200}, sorted(set(codes))
    ran = [w.stats().deep_probes - b for w, b in zip((prefill, decode), before)]
    assert all(n <= 8 for n in ran), ran  # the flood's own rounds, plus the health loops' of the gateways up


def test_concurrent_deep_checks_share_one_probe_on_the_worker(system):
    _, _, decode = system
    before = decode.stats().deep_probes
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        verdicts = list(pool.map(lambda _: decode.stub.Health(pb.HealthRequest(deep=True), timeout=30), range(64)))
    assert all(v.ok for v in verdicts)
    assert decode.stats().deep_probes - before < 32, decode.stats().deep_probes - before


def test_metrics_cover_the_gateway_and_every_worker(system, client):
    url, prefill, decode = system
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'pdserve_requests_total{endpoint="chat",status="ok"}' in text
    assert "pdserve_ttft_seconds_count" in text and "pdserve_e2e_seconds_count" in text
    for w in (prefill, decode):
        name = w.stats().worker
        total = [line for line in text.splitlines() if line.startswith(f'pdserve_worker_kv_blocks_total{{worker="{name}"}}')]
        assert total and float(total[0].split()[-1]) == w.stats().total_blocks, (name, total)
    assert "pdserve_worker_kv_blocks_transferred" in text


def test_chat_non_streaming_and_streaming_agree(client):
    full = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    parts, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(parts) == full.choices[0].message.content
    assert finish == "stop" and usage.completion_tokens == full.usage.completion_tokens


def test_completion_stop_string_ends_the_text(client):
    free = client.completions.create(model="smollm2", prompt="The sea is", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text.strip().split()[2]
    cut = client.completions.create(model="smollm2", prompt="The sea is", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_tokens_are_flushed_per_step_while_the_request_runs(system):
    url, _, decode = system
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "stream": True, "logit_bias": {"2": -100}}  # EOS (<|im_end|>) banned: all 200 tokens come
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        running = decode.stats().running_requests  # the first chunk is out before generation ended
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    assert running == 1 and rest[-1] == "data: [DONE]" and len(rest) > 3


def test_client_disconnect_frees_the_blocks(system):
    url, prefill, decode = system
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 500, "temperature": 0.8, "seed": 1,
            "stream": True, "logit_bias": {"2": -100}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    for w in (decode, prefill):  # closed mid-stream: the decode worker aborts, blocks come back
        s = wait_idle(w)
        assert s.free_blocks == s.total_blocks and s.running_requests == 0 and s.waiting_requests == 0


def test_a_client_leaving_a_non_streamed_request_cancels_it(system):
    url, _, decode = system
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 2000 tokens
        httpx.post(f"{url}/v1/completions", json=body, timeout=2.0)
    s = wait_idle(decode, timeout_s=15)  # cancelled when the client leaves (and a step), not after 2000 tokens
    assert s.running_requests == 0 and s.free_blocks == s.total_blocks, s


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": "smollm2", "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ({"model": "smollm2", "messages": CHAT, "temperature": 3}, 400, "temperature"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": []}, 400, "messages"),
    ({"model": "smollm2", "messages": CHAT, "n": 2}, 400, "n"),
    ({"model": "smollm2", "messages": CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": CHAT, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": CHAT, "stop": "x" * 60_000}, 400, "stop"),  # held back and searched per token
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi " * 9000}]}, 413, "messages"),
    ({"model": "gpt-5", "messages": CHAT}, 404, "model"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800 hi"}]}', 400, "messages"),
])
def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(system, client, body, status, param):
    url = system[0]
    if isinstance(body, bytes):
        resp = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    else:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    ok = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content


def test_oversized_body_is_413(system):
    resp = httpx.post(f"{system[0]}/v1/completions", content=b"x" * (2 << 20), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "error" in resp.json()


def _raw_post(url: str, head: dict[str, str], body_parts: list[bytes], finish: bool) -> bytes:
    """POST by hand: the head, then each part as a chunk (chunked encoding), the closing
    chunk only if `finish`; returns what the server answered within 10 s (b"" if nothing)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"POST /v1/completions HTTP/1.1", f"host: {host}", "transfer-encoding: chunked",
             "content-type: application/json", *(f"{k}: {v}" for k, v in head.items())]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for part in body_parts:
                s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            if finish:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed before taking it all: what we want
            pass
        data = b""
        while True:  # until the whole answer (its Content-Length) is in, the server closes, or 10 s pass
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return data
            data += chunk
            head, sep, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if not chunk or (sep and length and len(rest) >= int(length.group(1))):
                return data


def test_a_chunked_body_is_counted_as_it_arrives_and_refused_past_the_limit(system, smollm2_dir, tmp_path):
    """No Content-Length: the limit is enforced on the bytes as they come, so 413 comes while
    the client is still sending (it never finishes here), and nothing larger is parsed."""
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-body-bytes", "3000") as url:
        answer = _raw_post(url, {}, [b"x" * 1000] * 4, finish=False)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request body over 3000 bytes" in answer
        small = _raw_post(url, {}, [b'{"model": "smollm2", "prompt": "Hi", ', b'"max_tokens": 2}'], finish=True)
        assert small.startswith(b"HTTP/1.1 200"), small[:300]


def test_a_client_that_stops_sending_its_body_gets_408(system, smollm2_dir, tmp_path):
    """A half-sent body does not hold a connection open: past --body-timeout without a byte,
    408 and the connection back; a client that keeps sending is served."""
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--body-timeout", "1") as url:
        answer = _raw_post(url, {}, [b'{"model": "smollm2", '], finish=False)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"not received within 1s" in answer
        ok = _raw_post(url, {}, [b'{"model": "smollm2", "prompt": "Hi", ', b'"max_tokens": 2}'], finish=True)
        assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(tenant_gateway):
    """With API keys, a POST to the API gets 401 from its headers alone: a client that never
    finishes its body (or sends a huge one) gets its answer all the same."""
    for head in ({}, {"authorization": "Bearer nope"}):
        answer = _raw_post(tenant_gateway, head, [b'{"model": "smollm2", '], finish=False)
        assert answer.startswith(b"HTTP/1.1 401"), (head, answer[:200])
        assert b"invalid_api_key" in answer
    ok = _raw_post(tenant_gateway, {"authorization": "Bearer key-b"},
                   [b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2}'], finish=True)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_configured_limits_on_prompt_tokens_and_body_size(system, smollm2_dir, tmp_path):
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-prompt-tokens", "50", "--max-body-bytes", "3000") as url:
        long = httpx.post(f"{url}/v1/completions", timeout=30,
                          json={"model": "smollm2", "prompt": "word " * 100, "max_tokens": 2})
        assert long.status_code == 413 and long.json()["error"]["param"] == "prompt", long.text
        many = httpx.post(f"{url}/v1/chat/completions", timeout=30,  # refused before the template renders them
                          json={"model": "smollm2", "messages": [{"role": "user", "content": ""}] * 51, "max_tokens": 2})
        assert many.status_code == 413 and "51 messages cannot fit" in many.json()["error"]["message"], many.text
        big = httpx.post(f"{url}/v1/completions", timeout=30,
                         json={"model": "smollm2", "prompt": "x", "max_tokens": 2, "user": "u" * 4000})
        assert big.status_code == 413, big.text
        ok = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_openai_client_surfaces_the_errors(client):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT)
    with pytest.raises(BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2", messages=CHAT, temperature=-1)


@pytest.fixture(scope="module")
def tenant_gateway(system, smollm2_dir, tmp_path_factory):
    """A second gateway over the same workers, with API keys: tenant a (1 request at a time), b."""
    _, prefill, decode = system
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "a", "api_keys": ["key-a"], "max_concurrent": 1},
        {"name": "b", "api_keys": ["key-b"], "max_concurrent": 4, "priority": 1},
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


def test_one_tenants_prefix_cache_is_invisible_to_another(tenant_gateway):
    """Tenant a's prompt is cached for a (its second send reports cached tokens), but tenant
    b sending the very same prompt finds nothing: b cannot probe what a's prompts began with.
    A client's own cache_salt splits its tenant's cache further."""
    url = tenant_gateway
    prompt = "The lighthouse keeper counted the ships that passed in the night. " * 6  # several full blocks

    def cached(key: str, **extra) -> int:
        r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                       json={"model": "smollm2", "prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached("key-a")
    assert cached("key-a") > 0  # a hits its own cache
    assert cached("key-b") == 0  # the same prompt, another tenant: no hit
    assert cached("key-b") > 0  # b's own send is now cached for b
    assert cached("key-a", cache_salt="session-1") == 0  # a's client split its cache


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
        other = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": "Bearer key-b"})
        assert other.status_code == 200  # tenant b is not held back by a
    after = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, headers={"authorization": "Bearer key-a"})
    assert after.status_code == 200  # a's slot came back when its stream closed


def test_a_decode_worker_failing_before_the_first_token_is_retried_on_another(system, smollm2_dir, tmp_path):
    """The first decode worker in the list is a closed port; the request goes to the next one."""
    _, prefill, decode = system
    dead = f"127.0.0.1:{_free_port()}"
    log_path = tmp_path / "gateway.log"
    # --health-interval: no health round marks the dead worker before the request tries it
    with gateway(smollm2_dir, [dead, decode.address], [prefill.address], log_path,
                 "--health-interval", "3600") as url:
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "smollm2", "messages": CHAT, "max_tokens": 8, "temperature": 0})
        assert resp.status_code == 200 and "Paris" in resp.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{url}/ready", timeout=10).json() == {"ready": True}  # one live decode worker is enough
    assert f"decode worker {dead} unavailable, retrying on another" in log_path.read_text()


def test_overload_is_shed_with_fast_429s(system, smollm2_dir, tmp_path):
    """Past the predicted-TTFT bound the gateway answers 429 at once; admitted requests complete."""
    import concurrent.futures

    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-ttft", "1.5") as url:
        story = "Tell me a long story about the sea and its ships. " * 40  # ~450 tokens each

        def ask(i):
            return httpx.post(f"{url}/v1/completions", timeout=120,
                              json={"model": "smollm2", "prompt": f"{i} {story}", "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(ask, range(12)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 429}, codes
        assert 200 in codes and 429 in codes, codes  # some shed, the rest served
        shed = next(r for r in responses if r.status_code == 429)
        assert shed.json()["error"]["code"] == "overloaded" and int(shed.headers["retry-after"]) >= 1
        ok = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200  # the queue drained: admitted again


def test_ignore_eos_generates_exactly_max_tokens(client):
    short = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 60  # EOS came early
    out = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=60, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 60 and out.choices[0].finish_reason == "length"


def test_logprobs_in_openai_shapes(client):
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the top one
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = client.completions.create(model="smollm2", prompt="The sea is", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)


STORY = "Tell me a long story about the sea and its ships. " * 40  # ~450 tokens


def _data_lines(lines):
    return (line for line in lines if line.startswith("data: "))


def test_no_kv_headroom_is_a_fast_429_and_too_big_a_prompt_a_413(system, smollm2_dir, tmp_path):
    """A decode worker with 48 blocks (768 tokens): while one ~450-token request runs there is
    no room for another, so the gateway refuses it at once instead of queueing it."""
    _, prefill, _ = system
    (small,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "48"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [small.address], [prefill.address], tmp_path / "gateway.log",
                     "--health-interval", "0.2") as url:
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 200  # Stats read: capacity known
            huge = httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"model": "smollm2", "prompt": STORY * 2, "max_tokens": 1})
            assert huge.status_code == 413 and huge.json()["error"]["param"] == "prompt", huge.text
            too_long = httpx.post(f"{url}/v1/completions", timeout=30,
                                  json={"model": "smollm2", "prompt": STORY, "max_tokens": 400})
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens", too_long.text
            hold = {"model": "smollm2", "prompt": STORY, "max_tokens": 200, "stream": True, "logit_bias": {"2": -100}}
            with httpx.stream("POST", f"{url}/v1/completions", json=hold, timeout=60) as first:
                assert first.status_code == 200, first.read()
                lines = first.iter_lines()
                assert "error" not in next(_data_lines(lines))
                other = httpx.post(f"{url}/v1/completions", timeout=30,
                                   json={"model": "smollm2", "prompt": "Another: " + STORY[:1500], "max_tokens": 2})
                assert other.status_code == 429, other.text
                assert "KV cache room" in other.json()["error"]["message"] and other.headers["retry-after"] == "1"
                # answered at once, not queued behind the running request: that one is still running
                assert small.stats().running_requests == 1
            s = wait_idle(small)
            assert s.free_blocks == s.total_blocks
            time.sleep(0.5)  # a health round reads the freed blocks
            again = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"model": "smollm2", "prompt": "Another: " + STORY[:1500], "max_tokens": 2})
            assert again.status_code == 200, again.text
    finally:
        small.stop()


def test_a_decode_worker_dying_mid_stream_ends_the_stream_with_an_error_event(system, smollm2_dir, tmp_path):
    _, prefill, _ = system
    (doomed,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [doomed.address], [prefill.address], tmp_path / "gateway.log") as url:
            body = {"model": "smollm2", "messages": CHAT, "max_tokens": 400, "stream": True, "logit_bias": {"2": -100}}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                lines = _data_lines(resp.iter_lines())
                assert "error" not in json.loads(next(lines)[6:])
                doomed.kill()  # SIGKILL while tokens stream
                rest = list(lines)  # bounded: the gRPC stream breaks when the process dies
            assert rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(rest[-2][6:])["error"]
            assert "mid-stream" in error["message"] and error["type"] == "server_error"
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the gateway lives on
        s = wait_idle(prefill)
        assert s.free_blocks == s.total_blocks and s.running_requests == 0
    finally:
        doomed.stop()


def test_an_open_gateway_refuses_a_non_loopback_bind_unless_told(system, smollm2_dir, tmp_path):
    """No tenants file and an address other machines could reach: the gateway will not start,
    and says why; `--insecure-no-api-keys` (which names the risk) or API keys let it."""
    _, prefill, decode = system
    cmd = [sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--served-name", "smollm2",
           "--decode", decode.address, "--host", "0.0.0.0", "--port", str(_free_port())]
    refused = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to serve on 0.0.0.0 without API keys" in refused.stderr, refused
    port = _free_port()
    gw = subprocess.Popen([*cmd[:-1], str(port), "--insecure-no-api-keys"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert gw.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        gw.terminate()
        out, _ = gw.communicate(timeout=10)
    assert "with no API keys" in out  # warned, loudly


def _count(metrics: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = next((ln for ln in metrics.splitlines() if ln.startswith(f"{name}{{{want}}}" if want else f"{name} ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_a_stream_that_breaks_is_counted_as_an_error_with_its_latency(system, smollm2_dir, tmp_path):
    """The decode worker dies mid-stream: the client gets its error event, and /metrics
    counts the request as status="error" with its end-to-end time (the stream's reader stops
    at the error, so the count cannot wait for the stream to be read to its end)."""
    _, prefill, _ = system
    (doomed,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [doomed.address], [prefill.address], tmp_path / "gateway.log") as url:
            before = httpx.get(f"{url}/metrics", timeout=30).text
            body = {"model": "smollm2", "messages": CHAT, "max_tokens": 400, "stream": True, "logit_bias": {"2": -100}}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                lines = _data_lines(resp.iter_lines())
                next(lines)
                doomed.kill()
                rest = list(lines)
            assert "mid-stream" in rest[-2]
            after = httpx.get(f"{url}/metrics", timeout=30).text
            assert _count(after, "pdserve_requests_total", endpoint="chat", status="error") == \
                _count(before, "pdserve_requests_total", endpoint="chat", status="error") + 1, after
            assert _count(after, "pdserve_e2e_seconds_count") == _count(before, "pdserve_e2e_seconds_count") + 1
    finally:
        doomed.stop()


@pytest.mark.parametrize("field, value", [("top_k", 2**40), ("max_tokens", 2**40), ("seed", -1),
                                          ("logit_bias", {"\u00b2": 1.0}), ("logit_bias", {"1" * 40: 1.0})])
def test_a_value_the_wire_or_the_engine_cannot_hold_is_a_400_naming_it(system, field, value):
    """Every field is range-checked to what the proto (int32 top_k, max_tokens) and the engine
    accept: past it, 400 with the parameter named, never a 500."""
    url, _, _ = system
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", field: value})
    assert r.status_code == 400, (field, value, r.status_code, r.text)
    assert field in json.dumps(r.json()["error"]), r.text


@pytest.fixture(scope="module")
def one_seat(system, smollm2_dir, tmp_path_factory):
    """A gateway over a decode worker that runs one request and queues one more."""
    logs = tmp_path_factory.mktemp("one_seat")
    (small,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256", "--max-num-seqs", "1",
                                          "--max-waiting", "1"], {})], smollm2_dir, logs)
    try:
        with gateway(smollm2_dir, [small.address], [], logs / "gateway.log") as url:
            yield url, small
    finally:
        small.stop()


def test_a_decode_workers_queue_full_is_a_429_in_the_metrics_too(one_seat):
    """A decode worker whose queue is full answers RESOURCE_EXHAUSTED: the client gets 429,
    and /metrics counts it as status="429", not as an error of the system."""
    url, small = one_seat
    before = httpx.get(f"{url}/metrics", timeout=30).text
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body,
                                                   timeout=120).status_code, range(6)))
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    after = httpx.get(f"{url}/metrics", timeout=30).text
    shed = _count(after, "pdserve_requests_total", endpoint="completions", status="429") - \
        _count(before, "pdserve_requests_total", endpoint="completions", status="429")
    assert shed == codes.count(429), (codes, shed)
    assert _count(after, "pdserve_requests_total", endpoint="completions", status="error") == \
        _count(before, "pdserve_requests_total", endpoint="completions", status="error")
    wait_idle(small)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_its_first_token_is_cancelled_at_once(one_seat, stream):
    """A request queued behind another leaves before its first token: its gRPC call is
    cancelled then (the decode worker drops it from its queue), not when its first token
    would have come (after the running request's 3000 tokens)."""
    url, small = one_seat
    wait_idle(small)
    long = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=120) as running:
        lines = _data_lines(running.iter_lines())
        next(lines)
        queued = {"model": "smollm2", "prompt": "The sea is", "max_tokens": 8, "stream": stream}
        payload = json.dumps(queued).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            wait_until(lambda: small.stats().waiting_requests == 1, 60, "the second request queued")
        # ... and its client left, before anything of its answer came
        wait_until(lambda: small.stats().waiting_requests == 0, 120, "the queued request dropped")
        assert '"finish_reason": null' in next(lines)  # ... while the running request still runs
    s = wait_idle(small, timeout_s=30)
    assert s.running_requests == 0 and s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert _count(metrics, "pdserve_requests_total", endpoint="completions", status="cancelled") >= 1, metrics


def test_twice_max_num_seqs_open_streams_leave_health_and_stats_answered(system):
    """Every open Generate stream holds one of the decode worker's gRPC threads: with twice
    `max_num_seqs` (64) streams open, all are admitted (running or queued) and Health, deep
    too, and Stats are still answered; none waits inside gRPC for a thread."""
    _, _, decode = system
    streams = 2 * 64
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4], params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    calls = [decode.stub.Generate(pb.GenerateRequest(request_id=f"open-{i}", prompt_token_ids=req.prompt_token_ids,
                                                     params=req.params), timeout=300) for i in range(streams)]

    def all_open() -> bool:
        try:
            s = decode.stub.Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return False  # queued behind the streams for a thread
        return s.running_requests + s.waiting_requests == streams

    try:
        wait_until(all_open, 120, f"{streams} streams admitted at once")
        assert decode.stub.Health(pb.HealthRequest(), timeout=5).ok
        assert decode.stub.Health(pb.HealthRequest(deep=True), timeout=30).ok
    finally:
        for c in calls:
            c.cancel()
    s = wait_idle(decode, timeout_s=60)
    assert s.running_requests == 0 and s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s
