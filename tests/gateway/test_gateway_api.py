"""The gateway's OpenAI API in front of real prefill and decode processes (SmolLM2, float32),
driven by the official `openai` client and by raw HTTP for what a client library hides:
models, health, metrics, chat and completions, streamed and not, stop strings, logprobs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import time

import httpx
import pytest
from openai import BadRequestError, NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.gateway_procs import CHAT, FLOOD_LIMITS
from rpc import pdserve_pb2 as pb


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

    started = time.monotonic()
    codes = asyncio.run(flood())
    took = time.monotonic() - started
    assert set(codes) == {200}, sorted(set(codes))
    ran = [w.stats().deep_probes - b for w, b in zip((prefill, decode), before)]
    # The flood's own rounds (a handful), plus the health loops' rounds while it lasted: each
    # gateway up (this one and the session's aggregated one) probes every 2 s. On a slow or
    # busy host the flood lasts longer, and only the loops' share grows with it.
    loops = 2 * (math.ceil(took / 2.0) + 1)
    assert all(n <= 8 + loops for n in ran), (ran, f"{took:.1f} s")


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


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}, through Prometheus' own text parser."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s series that carry `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_one_scrape_shows_every_workers_step_and_transfer_metrics_and_they_move(system, client):
    """The gateway's /metrics is the whole system's: each worker's engine steps and the
    prefill worker's KV pushes, labelled by worker incarnation and role, grow with a
    disaggregated request."""
    url, prefill, decode = system
    names = {role: w.stats().worker for role, w in (("prefill", prefill), ("decode", decode))}
    before = _scrape(url)
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0)
    after = _scrape(url)
    for role, name in names.items():
        steps = [_total(s, "pdserve_engine_step_seconds_count", worker=name, role=role) for s in (before, after)]
        assert steps[1] > steps[0], (role, steps)
        tokens = [_total(s, "pdserve_engine_step_tokens_sum", worker=name) for s in (before, after)]
        assert tokens[1] > tokens[0], (role, tokens)
    pushed = [_total(s, "pdserve_kv_transfer_bytes_total", worker=names["prefill"], peer_role="decode")
              for s in (before, after)]
    assert pushed[1] > pushed[0], pushed
    seconds = [_total(s, "pdserve_kv_transfer_seconds_count", worker=names["prefill"]) for s in (before, after)]
    assert seconds[1] > seconds[0], seconds
    remote = [_total(s, "pdserve_prefills_total", worker=names["decode"], where="remote") for s in (before, after)]
    assert remote[1] == remote[0] + 1, remote
    decode_kinds = {dict(ls).get("kind") for (n, ls), v in after.items()
                    if n == "pdserve_engine_step_seconds_count" and ("worker", names["decode"]) in ls and v > 0}
    assert "decode" in decode_kinds, decode_kinds
    assert ("process_cpu_seconds_total", frozenset({("worker", names["decode"]), ("role", "decode")})) in after
    for role, name in names.items():  # each worker scheduled the request once: its queue time and prompt
        queued = [_total(s, "pdserve_engine_queue_seconds_count", worker=name) for s in (before, after)]
        assert queued[1] == queued[0] + 1, (role, queued)
        prompt = [_total(s, "pdserve_engine_prompt_tokens_total", worker=name) for s in (before, after)]
        assert prompt[1] > prompt[0], (role, prompt)
    # The same prompt again: the decode worker's prefix cache serves its full blocks.
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
    again = _scrape(url)
    hits = [_total(s, "pdserve_engine_prefix_cache_hit_tokens_total", worker=names["decode"]) for s in (after, again)]
    assert hits[1] > hits[0], hits


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


def test_every_answer_names_its_request_in_x_request_id(system, client):
    """The client's X-Request-Id comes back on the answer, streamed or not, errors too; with
    none, the header is the completion's own id; a malformed one is a 400 naming it."""
    url = system[0]
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=CHAT, max_tokens=2, temperature=0, extra_headers={"X-Request-Id": "trace-7f3a:1"})
    assert raw.headers["x-request-id"] == "trace-7f3a:1"
    raw = client.chat.completions.with_raw_response.create(model="smollm2", messages=CHAT, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id and raw.parse().id.startswith("chatcmpl-")
    with client.completions.with_streaming_response.create(
            model="smollm2", prompt="Hello", max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        assert any(line.startswith("data:") for line in r.iter_lines())
    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": CHAT},
                         headers={"X-Request-Id": "e-1"}, timeout=30)
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "e-1"
    for bad in ("has space", "x" * 129, "caf\u00e9"):
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2", "messages": CHAT},
                            headers=[("X-Request-Id", bad.encode("utf-8"))], timeout=30)
        assert answer.status_code == 400, (bad, answer.text)
        assert answer.json()["error"]["param"] == "X-Request-Id" and answer.headers["x-request-id"] != bad
    twice = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2", "messages": CHAT},
                       headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")], timeout=30)
    assert twice.status_code == 400, twice.text


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


def test_openai_client_surfaces_the_errors(client):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT)
    with pytest.raises(BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2", messages=CHAT, temperature=-1)


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


@pytest.mark.parametrize("text", ["line\u2028separator", "next\x85line", "para\u2029graph", "é\n\r\t"])
def test_an_sse_event_stays_one_line_whatever_the_text_holds(text):
    """Text a model can emit with characters that httpx's iter_lines (str.splitlines) breaks
    lines at, besides \\n and \\r: each event still reaches the client as one `data:` line
    whose JSON gives the text back (a streamed completion broke on U+2028 before)."""
    from httpx._decoders import LineDecoder

    from gateway.completions.answer import _data

    event = _data({"choices": [{"index": 0, "text": text}]})
    decoder = LineDecoder()
    lines = [line for line in decoder.decode(event.decode()) + decoder.flush() if line]
    assert len(lines) == 1 and lines[0].startswith("data: "), lines
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
