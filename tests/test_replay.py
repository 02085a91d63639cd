"""A decode worker killed mid-stream costs a replay, not a request (gateway/decode_stream.py):
the gateway resubmits each of its streams to another decode worker as prompt + the tokens
already streamed, and the client reads on. Real workers, a real gateway, kill -9.

The references are the same requests left alone, on the worker that survives: a greedy
float32 request, a seeded sampled one and a structured-output one each give exactly the
tokens they give when nothing fails (the seeded sampler's positions, the penalties and the
grammar's state continue from the streamed tokens), and the structured one validates."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import jsonschema
import pytest

from tests.gateway_procs import admin_gateway, data_lines, gateway, metric_value
from tests.worker_procs import start_workers, wait_idle

ADMIN_TOKEN = "admin-token-for-the-replay-test"
ARGS = ["--dtype", "float32", "--kv-blocks", "256"]
PROMPT = [{"role": "user", "content": "Write a long letter to a friend about the sea."}]
WORDS = {"type": "object", "properties": {"words": {"type": "array", "minItems": 24, "maxItems": 24, "items": {
    "type": "string", "minLength": 3, "maxLength": 10}}}, "required": ["words"], "additionalProperties": False}
BODIES = {
    "greedy": {"temperature": 0, "max_tokens": 160, "logit_bias": {"2": -100}, "frequency_penalty": 0.5},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 160, "logit_bias": {"2": -100},
               "presence_penalty": 0.3},
    "schema": {"temperature": 0, "max_tokens": 400,
               "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WORDS,
                                                                           "strict": True}}},
}
CHUNKS_BEFORE_KILL = 4


@pytest.fixture(scope="module")
def workers(smollm2_dir, tmp_path_factory):
    procs = start_workers([("prefill", ARGS, {}), ("decode", ARGS, {}), ("decode", ARGS, {})], smollm2_dir,
                          tmp_path_factory.mktemp("replay"), timeout_s=120)
    yield procs
    for w in procs:
        w.stop()


def _body(name: str) -> dict:
    return {"model": "smollm2", "messages": PROMPT, "stream": True, **BODIES[name]}


def _text(lines) -> tuple[str, list[dict]]:
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")), events


def test_streams_of_a_killed_decode_worker_continue_on_another_exactly(workers, smollm2_dir, tmp_path):
    p, a, b = workers
    with gateway(smollm2_dir, [b.address], [p.address], tmp_path / "ref.log") as ref:
        want = {}
        for name in BODIES:
            with httpx.stream("POST", f"{ref}/v1/chat/completions", json=_body(name), timeout=120) as resp:
                want[name], _ = _text(list(data_lines(resp.iter_lines())))
    log = tmp_path / "gateway.log"
    with admin_gateway(smollm2_dir, [a.address], [p.address], log, ADMIN_TOKEN, "--health-interval", "3600") \
            as (url, members):
        _kill_under_streams(url, members, workers, want, log)


def _kill_under_streams(url, members, workers, want, log) -> None:
    p, a, b = workers
    before = httpx.get(f"{url}/metrics", timeout=30).text
    started = {name: threading.Event() for name in BODIES}
    killed = threading.Event()

    def read(name: str) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(name), timeout=120) as resp:
            assert resp.status_code == 200
            lines = []
            for line in data_lines(resp.iter_lines()):
                lines.append(line)
                if len(lines) == CHUNKS_BEFORE_KILL:
                    started[name].set()
                    assert killed.wait(60)
            return lines

    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        reads = {name: pool.submit(read, name) for name in BODIES}  # all on A: the gateway knows no other yet
        for name, event in started.items():
            assert event.wait(120), (name, reads[name].exception() if reads[name].done() else None)
        members([a.address, b.address], [p.address])
        a.kill()  # kill -9 while every stream is mid-way
        killed.set()
        got = {name: _text(f.result(timeout=180)) for name, f in reads.items()}
    for name, (text, events) in got.items():
        assert not any("error" in e for e in events), (name, events[-2:])
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), (name, events[-1])
        assert text == want[name], (name, text, want[name])
    jsonschema.validate(json.loads(got["schema"][0]), WORDS)
    gateway_log = log.read_text()
    assert gateway_log.count(f"; replayed on {b.address} as ") == len(BODIES), gateway_log[-3000:]
    after = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(after, "pdserve_decode_retries_total", when="mid_stream") == \
        metric_value(before, "pdserve_decode_retries_total", when="mid_stream") + len(BODIES)
    for status, more in (("ok", len(BODIES)), ("error", 0)):
        assert metric_value(after, "pdserve_requests_total", endpoint="chat", status=status) == \
            metric_value(before, "pdserve_requests_total", endpoint="chat", status=status) + more, status
    for w in (p, b):
        s = wait_idle(w)
        assert s.free_blocks == s.total_blocks and s.running_requests == s.waiting_requests == 0, s
