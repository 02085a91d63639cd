"""API keys and tenants: refused before the body is read, limits per tenant given back on
every path, prefix caches kept apart."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from bench.harness.gateway_procs import CHAT, gateway, raw_post


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
    from gateway.tenants import Tenant

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
        refused = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                   if line.startswith('pdserve_rejections_total{reason="tenant_concurrency"}')]
        assert refused and float(refused[0].split()[-1]) >= 1, refused
        other = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": "Bearer key-b"})
        assert other.status_code == 200  # tenant b is not held back by a
    after = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, headers={"authorization": "Bearer key-a"})
    assert after.status_code == 200  # a's slot came back when its stream closed
