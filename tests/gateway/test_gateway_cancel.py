"""Clients that leave, at any moment of their request: the decode worker's call is cancelled
at once (queued, prefilling or streaming) and every block and claim comes back."""

from __future__ import annotations

import concurrent.futures
import json
import socket

import httpx
import pytest

from bench.harness.gateway_procs import CHAT, data_lines, gateway, metric_value
from bench.harness.worker_procs import start_workers, wait_idle, wait_until


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
    shed = metric_value(after, "pdserve_requests_total", endpoint="completions", status="429") - \
        metric_value(before, "pdserve_requests_total", endpoint="completions", status="429")
    assert shed == codes.count(429), (codes, shed)
    assert metric_value(after, "pdserve_requests_total", endpoint="completions", status="error") == \
        metric_value(before, "pdserve_requests_total", endpoint="completions", status="error")
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
        lines = data_lines(running.iter_lines())
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
    assert metric_value(metrics, "pdserve_requests_total", endpoint="completions", status="cancelled") >= 1, metrics
