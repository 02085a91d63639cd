"""Decode workers that fail under the gateway: before the first token (retried on another),
mid-stream (an error event, counted as an error with its latency)."""

from __future__ import annotations

import json

import httpx

from bench.harness.gateway_procs import CHAT, data_lines, gateway, metric_value
from bench.harness.worker_procs import free_port, start_workers, wait_idle


def test_a_decode_worker_failing_before_the_first_token_is_retried_on_another(system, smollm2_dir, tmp_path):
    """The first decode worker in the list is a closed port; the request goes to the next one."""
    _, prefill, decode = system
    dead = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "gateway.log"
    # --health-interval: no health round marks the dead worker before the request tries it;
    # routing as before the prefix index, which knows the live worker holds CHAT's blocks
    with gateway(smollm2_dir, [dead, decode.address], [prefill.address], log_path,
                 "--health-interval", "3600", "--no-prefix-routing") as url:
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "smollm2", "messages": CHAT, "max_tokens": 8, "temperature": 0})
        assert resp.status_code == 200 and "Paris" in resp.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{url}/ready", timeout=10).json() == {"ready": True}  # one live decode worker is enough
    assert f"decode worker {dead} unavailable, retrying on another" in log_path.read_text()


def test_a_decode_worker_dying_mid_stream_ends_the_stream_with_an_error_event(system, smollm2_dir, tmp_path):
    _, prefill, _ = system
    (doomed,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [doomed.address], [prefill.address], tmp_path / "gateway.log") as url:
            body = {"model": "smollm2", "messages": CHAT, "max_tokens": 400, "stream": True, "logit_bias": {"2": -100}}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                lines = data_lines(resp.iter_lines())
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
                lines = data_lines(resp.iter_lines())
                next(lines)
                doomed.kill()
                rest = list(lines)
            assert "mid-stream" in rest[-2]
            after = httpx.get(f"{url}/metrics", timeout=30).text
            assert metric_value(after, "pdserve_requests_total", endpoint="chat", status="error") == \
                metric_value(before, "pdserve_requests_total", endpoint="chat", status="error") + 1, after
            assert metric_value(after, "pdserve_e2e_seconds_count") == metric_value(before, "pdserve_e2e_seconds_count") + 1
    finally:
        doomed.stop()
