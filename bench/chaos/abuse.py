"""The abuse scenario: fuzzed requests, limit probes, connections that stop halfway and a
burst past a tenant's stream limit. Every request carries a tenant's API key (the shared
deployment has a tenants file), so each reaches the check it probes, not the 401."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import psutil

from bench.chaos.client import auth, client, completion, send
from bench.chaos.context import Chaos, settle
from bench.chaos.report import Outcome, Result
from bench.chaos.sizes import CLIENT_TIMEOUT_S, MODEL
from gateway.front_door.head_deadline import CLIENT_KEEPALIVE_EXPIRY_S as KEEPALIVE_EXPIRY_S

BURST = 96  # streams sent at once by one tenant, each of BURST_TOKENS: their slots stay held a while
BURST_TOKENS = 32
BURST_LIMIT = 16  # that tenant's max_concurrent: past it, a 429 naming the limit at once
# In the shared deployment's tenants file (bench/chaos/scenarios.py).
BURST_TENANT = {"name": "burst", "share_prefix_cache": True, "max_concurrent": BURST_LIMIT}


def _limit_probes() -> list[tuple[str, bytes]]:
    """Bodies past every documented limit, and inputs that have broken JSON servers before.
    All but the 2 MiB body fit the shared deployment's 64 KiB body cap (bench/chaos/tenant_abuse.py
    GATEWAY), so each reaches the check it probes rather than the 413."""
    def js(obj: dict) -> bytes:
        return json.dumps(obj).encode()
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [
        ("2 MiB body", js({**base, "prompt": "a " * (1 << 20)})),
        ("prompt past the context", js({**base, "prompt": [1000] * 9000})),
        ("prompt ids out of range", js({**base, "prompt": [-1, 10**12]})),
        ("max_tokens 10**12", js({**base, "max_tokens": 10**12})),
        ("max_tokens 0", js({**base, "max_tokens": 0})),
        ("10k stop strings", js({**base, "stop": ["x"] * 10_000})),
        ("a 60k-character stop string", js({**base, "stop": "x" * 60_000})),
        ("stop strings of 512 characters, 16 of them", js({**base, "max_tokens": 64, "stop": ["y" * 512] * 16})),
        ("4k logit_bias entries", js({**base, "logit_bias": {str(i): 1 for i in range(4_000)}})),
        ("logit_bias key 10**30", js({**base, "logit_bias": {str(10**30): 1}})),
        ("seed 10**400", b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "seed": 1' + b"0" * 400 + b"}"),
        ("NaN temperature", b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}'),
        ("lone surrogate in the prompt", b'{"model": "smollm2", "prompt": "\\ud800 hi", "max_tokens": 2}'),
        ("lone surrogate in a stop string",
         b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 4, "stop": ["\\udfff"]}'),
        ("lone surrogate in the model", b'{"model": "\\ud800", "prompt": "Hi", "max_tokens": 2}'),
        ("JSON nested 30k deep", b'{"model": "smollm2", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"),
        ("not JSON", b"{'model': smollm2"),
        ("empty body", b""),
        ("a JSON array", b"[1, 2, 3]"),
        ("chat: 1,500 messages, past the context",
         js({**chat, "messages": [{"role": "user", "content": "hi"}] * 1_500})),
        ("chat: lone surrogate",
         b'{"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("chat: image part", js({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
    ]


def fuzz(url: str, examples: int, seed: int) -> tuple[Counter, list[str]]:
    """schemathesis (valid and invalid bodies from the gateway's OpenAPI), hypothesis bodies
    and headers, and the limit probes: the status counts, and what answered 5xx (or broke)."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    statuses: Counter = Counter()
    bad: list[str] = []
    run = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    def seen(what: str, status: int | None, text: str = "") -> None:
        statuses[status or "no answer"] += 1
        if status is None or status >= 500:
            bad.append(f"{what[:200]} -> {status}: {text[:200]}")

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @run
        @hypothesis_seed(seed)
        @given(case=schema.as_strategy(mode), served=st.booleans())
        def openapi(case, served):
            if served and mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = MODEL  # else nearly every valid body is a 404 for its random model
                for key in ("max_tokens", "max_completion_tokens"):  # short, so the run stays bounded
                    case.body[key] = min(case.body.get(key) or 4, 4)
            try:
                r = case.call(base_url=url, headers=auth(), timeout=CLIENT_TIMEOUT_S)
                seen(f"{case.method} {case.path} {case.body!r}", r.status_code, r.text)
            except Exception as e:  # a transport error: the server dropped the request
                seen(f"{case.method} {case.path} {case.body!r}", None, repr(e))

        openapi()

    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                              lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                        max_size=4), max_leaves=12)
    fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "stream", "stop", "logit_bias", "n",
                              "temperature", "top_p", "top_k", "seed", "logprobs", "echo", "stream_options",
                              "ignore_eos", "max_completion_tokens", "top_logprobs", "user"])
    header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,24}", fullmatch=True).filter(  # the key stays the tenant's
        lambda h: h.lower() not in ("host", "content-length", "transfer-encoding", "connection", "expect",
                                    "authorization"))
    header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip)
    base = {"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    @run
    @hypothesis_seed(seed)
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           body=st.one_of(st.binary(max_size=300), st.dictionaries(fields, json_value, max_size=4).map(
               lambda d: json.dumps({**base, **d}).encode())),
           content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded",
                                         "multipart/form-data; boundary=x", "application/json; charset=latin-1"]),
           headers=st.dictionaries(header_names, header_values, max_size=4),
           stream=st.booleans())
    def raw(path, body, content_type, headers, stream):
        if stream and body.startswith(b"{"):
            body = body[:-1] + b', "stream": true}'
        try:
            r = httpx.post(f"{url}{path}", content=body, headers={**auth(), **headers, "Content-Type": content_type},
                           timeout=CLIENT_TIMEOUT_S)
            seen(f"POST {path} {body[:200]!r} {headers}", r.status_code, r.text)
        except httpx.HTTPError as e:
            seen(f"POST {path} {body[:200]!r} {headers}", None, repr(e))

    raw()
    for what, body in _limit_probes():
        for path in ("/v1/completions", "/v1/chat/completions"):
            try:
                r = httpx.post(f"{url}{path}", content=body, headers={**auth(), "Content-Type": "application/json"},
                               timeout=CLIENT_TIMEOUT_S)
                seen(f"{what} on {path}", r.status_code, r.text)
            except httpx.HTTPError as e:
                seen(f"{what} on {path}", None, repr(e))
    return statuses, bad


def chunked_oversize(url: str) -> tuple[int | None, str]:
    """A 2 MiB body sent chunked (no Content-Length, so the limit must be counted as it
    arrives): the status, and the answer."""
    def body():
        yield b'{"model": "smollm2", "max_tokens": 2, "prompt": "'
        for _ in range(32):
            yield b"a " * 32768  # 64 KiB a chunk
        yield b'"}'
    try:
        r = httpx.post(f"{url}/v1/completions", content=body(), headers={**auth(), "Content-Type": "application/json"},
                       timeout=CLIENT_TIMEOUT_S)
        return r.status_code, r.text
    except httpx.HTTPError as e:  # the server answered 413 and closed before taking the rest: fine
        return (413, repr(e)) if "413" in repr(e) else (None, repr(e))


async def ready_flood(url: str, n: int) -> Counter:
    """`n` GETs of /ready and of /metrics at once: open routes, so they must not amplify."""
    limits = httpx.Limits(max_connections=100, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        async def one(path: str):
            try:
                return (await http.get(f"{url}/{path}")).status_code
            except httpx.HTTPError:
                return None
        return Counter(await asyncio.gather(*(one(p) for _ in range(n) for p in ("ready", "metrics"))))


async def slow_head(url: str, limit_s: float = 120.0) -> str:
    """A connection that sends its request head one byte every 0.5 s: the gateway must answer
    408 and close it at the head's deadline (--header-timeout), not hold it open. Returns
    "408", "closed" (cut off without an answer) or "held open" (still open after limit_s)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
    deadline, sent = time.monotonic() + limit_s, 0
    try:
        while time.monotonic() < deadline:
            writer.write(head[sent:sent + 1] or b"x")
            sent += 1
            try:
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(64), 0.5)
            except asyncio.TimeoutError:
                continue
            except OSError:
                return "closed"
            return "408" if answer.startswith(b"HTTP/1.1 408") else ("closed" if not answer else answer[:12].decode())
        return "held open"
    finally:
        writer.close()


async def half_read(url: str, rng: random.Random) -> None:
    """A raw connection that stops halfway: through sending its body, or through reading the
    SSE stream, then closes."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(completion(rng.randint(8, 64), 64, rng)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth()['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if rng.random() < 0.2:  # the body stops partway: the server waits for the rest, then sees the close
            writer.write(head + body[:rng.randint(0, len(body) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            return
        writer.write(head + body)
        await writer.drain()
        want, got = rng.randint(1, 1500), 0
        while got < want:
            chunk = await asyncio.wait_for(reader.read(want - got), CLIENT_TIMEOUT_S)
            if not chunk:
                return
            got += len(chunk)
    finally:
        writer.close()


async def abuse(ctx: Chaos) -> Result:
    """Fuzzed requests, limit probes, SSE reads that stop halfway, heads sent byte by byte
    and a burst past a tenant's concurrent-stream limit (each of it served, or a 429 naming
    the limit): no 5xx, the gateway alive, its memory flat."""
    res, dep, s, rng = Result("abuse", no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    incarnations = {(w["role"], w["worker_id"]): w["incarnation"] for w in await asyncio.to_thread(dep.workers)}
    gateway = await asyncio.to_thread(dep.gateway)
    rss = [gateway.memory_info().rss / 2**20]
    statuses, bad, burst, flooded, slow_heads = Counter(), [], [], Counter(), Counter()
    for _ in range(s.abuse_rounds):
        round_statuses, round_bad = await asyncio.to_thread(fuzz, dep.url, s.fuzz_examples, rng.randrange(2**32))
        statuses.update(round_statuses)
        bad += round_bad
        code, text = await asyncio.to_thread(chunked_oversize, dep.url)
        statuses[code or "no answer"] += 1
        if code != 413:
            bad.append(f"2 MiB chunked body -> {code}: {text[:200]}")
        flood = await ready_flood(dep.url, 300)
        flooded.update(flood)
        bad += [f"/ready or /metrics flood -> {code} (x {n})" for code, n in flood.items() if code is None or code >= 500]
        await asyncio.gather(*(half_read(dep.url, rng) for _ in range(s.half_reads)))
        heads = Counter(await asyncio.gather(*(slow_head(dep.url) for _ in range(16))))
        slow_heads.update(heads)
        bad += [f"a head sent byte by byte -> {what} (x {n})" for what, n in heads.items() if what != "408"]
        async with client(BURST_TENANT["name"]) as http:  # more streams at once than its limit
            burst += await asyncio.gather(*(send(http, dep.url, completion(16, BURST_TOKENS, rng))
                                            for _ in range(BURST)))
        try:
            rss.append(gateway.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
    res.completed += sum(n for code, n in statuses.items() if isinstance(code, int) and code < 300)
    res.failed_cleanly += sum(n for code, n in statuses.items() if isinstance(code, int) and 400 <= code < 500)
    res.http_5xx += sum(n for code, n in statuses.items() if isinstance(code, int) and code >= 500)
    res.dropped += statuses.get("no answer", 0)
    alive = await asyncio.to_thread(lambda: httpx.get(f"{dep.url}/health", timeout=10).status_code == 200)
    res = await settle(ctx, res, burst)
    same = (await asyncio.to_thread(dep.gateway)).pid == gateway.pid
    after = {(w["role"], w["worker_id"]): w["incarnation"] for w in await asyncio.to_thread(dep.workers)}
    replaced = sorted(f"{r}-{i}" for (r, i), inc in incarnations.items() if after.get((r, i)) != inc)
    if replaced:
        res.broken.append(f"workers replaced during abuse: {', '.join(replaced)}")
    burst_429 = sum(r.status == 429 for r in burst)
    burst_other = Counter(f"{r.status} {r.code or r.error[:60]}" for r in burst if r.outcome is not Outcome.COMPLETED
                          and not (r.status == 429 and r.code == "tenant_concurrency_limit"))
    if not burst_429:
        res.broken.append(f"no 429 for {len(burst)} streams sent at once by a tenant limited to {BURST_LIMIT}")
    if burst_other:
        res.broken.append(f"burst streams neither served nor refused at the tenant's limit: {dict(burst_other)}")
    res.figures.update(statuses={str(k): v for k, v in sorted(statuses.items(), key=str)}, bad=bad[:20],
                       burst_429=burst_429, burst_other=dict(burst_other), gateway_alive=alive and same,
                       gateway_rss_mb=rss)
    res.figures.update(replaced=replaced, ready_flood={str(k): v for k, v in flooded.items()},
                       slow_heads=dict(slow_heads))
    res.failed_cleanly += slow_heads.get("408", 0)
    res.dropped += sum(n for what, n in slow_heads.items() if what != "408")
    res.http_5xx += sum(n for code, n in flooded.items() if code is not None and code >= 500)
    res.notes.append(f"{sum(statuses.values())} fuzzed, {len(bad)} x 5xx/no answer; {len(burst)} streams in "
                     f"bursts of {BURST} (limit {BURST_LIMIT}): {burst_429} x 429; "
                     f"gateway {'alive' if alive and same else 'RESTARTED'}, "
                     f"RSS MB {'->'.join(f'{x:.0f}' for x in rss)}")
    if not (alive and same):
        res.http_5xx += 1  # counted as a failure: the gateway went down under abuse
    return res

