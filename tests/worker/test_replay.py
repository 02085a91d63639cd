"""A decode worker that leaves mid-stream costs a move, not a request (gateway/decode_stream.py):
the gateway resubmits each of its streams to another decode worker as prompt + the tokens
already streamed, and the client reads on. Drained, the worker keeps each stream's KV and
the taker copies it over NIXL (decode/kv_source.py); killed with kill -9, the taker has
the KV of the streamed tokens prefilled by the prefill worker. Real workers, a real gateway.

The references are the same requests left alone, on the worker that survives: a greedy
float32 request, a seeded sampled one and a structured-output one each give exactly the
tokens they give when nothing fails (the seeded sampler's positions, the penalties and the
grammar's state continue from the streamed tokens), and the structured one validates."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import httpx
import jsonschema
import pytest

from bench.harness.gateway_procs import admin_gateway, data_lines, gateway, metric_value
from bench.harness.worker_procs import start_workers, wait_idle
from deploy.drain import DrainEnd, drain, holdings_of
from deploy.observe.trace import timelines
from rpc import pdserve_pb2 as pb

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
CHUNKS_BEFORE_MOVE = 4


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


@pytest.fixture(scope="module")
def want(workers, smollm2_dir, tmp_path_factory) -> dict[str, str]:
    """Each request's text left alone, on B (the worker every move lands on)."""
    p, _, b = workers
    texts = {}
    with gateway(smollm2_dir, [b.address], [p.address], tmp_path_factory.mktemp("ref") / "ref.log") as ref:
        for name in BODIES:
            with httpx.stream("POST", f"{ref}/v1/chat/completions", json=_body(name), timeout=120) as resp:
                texts[name], _ = _text(list(data_lines(resp.iter_lines())))
    return texts


def test_streams_of_a_drained_decode_worker_move_with_their_kv_exactly(workers, want, smollm2_dir, tmp_path):
    p, _, b = workers
    (d,) = start_workers([("decode", ARGS, {})], smollm2_dir, tmp_path)
    log = tmp_path / "gateway.log"
    try:
        with admin_gateway(smollm2_dir, [d.address], [p.address], log, ADMIN_TOKEN, "--health-interval", "3600") \
                as (url, members):
            def hand_off() -> None:
                members([b.address], [p.address])  # the controller's first move: out of the membership
                result = drain(lambda: holdings_of(d.stub.Drain(pb.DrainRequest(hand_off=True), timeout=30)),
                               d.alive, lambda: True, bound_s=300, health_interval_s=2, unhealthy_after=3)
                assert result.end is DrainEnd.EMPTY, result

            _move_under_streams(url, hand_off, "handed_off", want, log)
        d_log, b_log = d.log_path.read_text(errors="replace"), b.log_path.read_text(errors="replace")
        assert d_log.count("kept KV pushed to its taker") == len(BODIES), d_log[-3000:]
        assert b_log.count(f"KV from {d.address}") == len(BODIES), b_log[-3000:]
        # `pdserve trace ID` shows the hop: kept on D, copied to B, decoded on there.
        rid = re.search(r"request (\S+): decode worker \S+ handed it off", log.read_text()).group(1)
        (line,) = timelines([log, d.log_path, b.log_path], rid)
        names = [(e.role, e.name) for e in line.events]
        for hop in (("decode", "kv_kept"), ("decode", "kv_pull"), ("decode", "kv_released"), ("gateway", "replayed")):
            assert hop in names, (hop, names)
        assert any(e.name == "admitted" and e.fields.get("prefill") == "kv_source" for e in line.events), names
        assert any(e.name == "kv_released" and e.fields.get("outcome") == "done" for e in line.events), names
        _assert_idle(p, b)
    finally:
        d.stop()


def test_streams_of_a_killed_decode_worker_continue_on_another_exactly(workers, want, tmp_path, smollm2_dir):
    p, a, b = workers
    log = tmp_path / "gateway.log"
    with admin_gateway(smollm2_dir, [a.address], [p.address], log, ADMIN_TOKEN, "--health-interval", "3600") \
            as (url, members):
        def kill() -> None:
            members([a.address, b.address], [p.address])
            a.kill()  # kill -9 while every stream is mid-way

        replays_before = b.log_path.read_text(errors="replace").count(", remote prefill")
        _move_under_streams(url, kill, "mid_stream", want, log)
    # The streamed tokens' KV came from the prefill worker: B computed no replay's prefill.
    b_log = b.log_path.read_text(errors="replace")
    assert b_log.count(", remote prefill") - replays_before == len(BODIES), b_log[-3000:]
    assert "prefilling locally" not in b_log
    _assert_idle(p, b)


def _move_under_streams(url, move, label, want, log) -> None:
    """Every body streaming through `url`, `move` once each is mid-way, then every stream
    read to its end: the text it gives left alone, no error, one move each (metric `label`)."""
    before = httpx.get(f"{url}/metrics", timeout=30).text
    started = {name: threading.Event() for name in BODIES}
    moved = threading.Event()

    def read(name: str) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(name), timeout=120) as resp:
            assert resp.status_code == 200
            lines = []
            for line in data_lines(resp.iter_lines()):
                lines.append(line)
                if len(lines) == CHUNKS_BEFORE_MOVE:
                    started[name].set()
                    assert moved.wait(120)
            return lines

    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        reads = {name: pool.submit(read, name) for name in BODIES}  # all on one worker: the gateway knows no other yet
        for name, event in started.items():
            assert event.wait(120), (name, reads[name].exception() if reads[name].done() else None)
        move()
        moved.set()
        got = {name: _text(f.result(timeout=180)) for name, f in reads.items()}
    for name, (text, events) in got.items():
        assert not any("error" in e for e in events), (name, events[-2:])
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), (name, events[-1])
        assert text == want[name], (name, text, want[name])
    jsonschema.validate(json.loads(got["schema"][0]), WORDS)
    assert log.read_text().count(" as ") >= len(BODIES)
    after = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(after, "pdserve_decode_retries_total", when=label) == \
        metric_value(before, "pdserve_decode_retries_total", when=label) + len(BODIES)
    for status, more in (("ok", len(BODIES)), ("error", 0)):
        assert metric_value(after, "pdserve_requests_total", endpoint="chat", status=status) == \
            metric_value(before, "pdserve_requests_total", endpoint="chat", status=status) + more, status


def _assert_idle(*workers) -> None:
    for w in workers:
        s = wait_idle(w)
        assert s.free_blocks == s.total_blocks and s.running_requests == s.waiting_requests == 0, s


def test_a_hand_off_no_worker_takes_lets_the_drained_worker_release_its_kept_kv(workers, smollm2_dir, tmp_path):
    """The only decode worker is drained with hand-off: its stream's KV is kept for a taker,
    but there is none, so the gateway gives the hand-off up (the stream ends with an error
    event) and tells the drained worker, which releases the kept blocks at once instead of
    holding them, and its drain, to the end of their hold."""
    p = workers[0]
    (d,) = start_workers([("decode", ARGS, {})], smollm2_dir, tmp_path)
    log = tmp_path / "gateway.log"
    try:
        with admin_gateway(smollm2_dir, [d.address], [p.address], log, ADMIN_TOKEN, "--health-interval", "3600") \
                as (url, _):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body("greedy"), timeout=120) as resp:
                lines = data_lines(resp.iter_lines())
                for _ in range(CHUNKS_BEFORE_MOVE):
                    assert "error" not in next(lines)
                result = drain(lambda: holdings_of(d.stub.Drain(pb.DrainRequest(hand_off=True), timeout=30)),
                               d.alive, lambda: True, bound_s=300, health_interval_s=2, unhealthy_after=3)
                rest = list(lines)
            assert result.end is DrainEnd.EMPTY, result
            assert rest[-1] == "data: [DONE]" and "error" in rest[-2], rest[-3:]
        d_log = d.log_path.read_text(errors="replace")
        assert "its gateway gave its hand-off up; kept KV released" in d_log, d_log[-3000:]
        assert "was not pulled in time" not in d_log
    finally:
        d.stop()
