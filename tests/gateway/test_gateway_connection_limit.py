"""Past `--max-connections` a request gets the gateway's JSON 503 (never uvicorn's plain-text
one), whose Retry-After is the time the connections over the limit take to close at the rate
connections closed lately, and the slots come back once connections close."""

from __future__ import annotations

import json
import math
import socket
import time

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from gateway.front_door.connection_limit import WINDOW_CLOSES, WINDOW_S, ConnectionTurnover, over_limit

LIMIT = 2


def test_the_wait_is_the_excess_at_the_rate_connections_closed_lately():
    turnover = ConnectionTurnover(idle_close_s=5.0)
    assert turnover.wait_s(1, now=100.0) == 5.0  # nothing measured: when an idle connection is closed
    for t in (100.0, 101.0, 102.0, 103.0):
        turnover.closed(t)
    assert turnover.wait_s(1, now=104.0) == pytest.approx(1.0)  # 4 closes in 4 s
    assert turnover.wait_s(3, now=104.0) == pytest.approx(3.0)
    assert turnover.wait_s(1, now=112.0) == pytest.approx(3.0)  # none since: the rate falls as time passes
    assert turnover.wait_s(1000, now=104.0) == WINDOW_S  # never longer than the window it measures
    assert turnover.wait_s(1, now=103.0 + WINDOW_S + 1) == 5.0  # closes past the window say nothing
    for t in range(WINDOW_CLOSES):  # the rate over the latest closes only
        turnover.closed(200.0 + t / 100)
    assert turnover.wait_s(1, now=200.0 + WINDOW_CLOSES / 100) == pytest.approx(0.01)


def test_over_limit_counts_connections_with_the_asking_one_and_requests_without_it():
    assert over_limit(2, connections=2, requests=1) == 0
    assert over_limit(2, connections=3, requests=0) == 1
    assert over_limit(2, connections=1, requests=2) == 1  # requests on other connections (pipelined)
    assert over_limit(2, connections=5, requests=0) == 3


@pytest.fixture(scope="module")
def url(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("connection_limit") / "gateway.log"
    with gateway(smollm2_dir, ["127.0.0.1:1"], [], log, "--max-connections", str(LIMIT)) as url:
        yield url


def _get(host: str, port: int, close: bool) -> socket.socket:
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(f"GET /v1/models HTTP/1.1\r\nhost: {host}\r\n{'connection: close' if close else ''}\r\n\r\n".encode())
    return s


def _answer(s: socket.socket) -> bytes:
    """What the server sends until it closes (a bound of 30 s, not a speed)."""
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


def test_past_the_limit_a_request_gets_a_json_503_with_a_measured_retry_after(url):
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    began = time.monotonic()
    for _ in range(WINDOW_CLOSES):  # a window's worth of connections closed, all from now on
        with _get(host, port, close=True) as s:
            assert _answer(s).startswith(b"HTTP/1.1 200")
    held = [socket.create_connection((host, port), timeout=30) for _ in range(LIMIT)]
    try:
        with _get(host, port, close=False) as over:
            answer = _answer(over)  # closed after the answer: never a bare close
        span = time.monotonic() - began
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"content-type: application/json" in head, answer[:300]
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and f"limit of {LIMIT} connections" in error["message"], error
        retry_after = int(head.split(b"retry-after: ")[1].split(b"\r\n")[0])
        # the one connection over the limit, at the rate the gateway saw the closes above: they
        # all came within `span`, so at most span / WINDOW_CLOSES (rounded up), whatever the host
        assert 1 <= retry_after <= max(1, math.ceil(span / WINDOW_CLOSES)), (retry_after, span)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 30  # the held connections' closes reach the gateway: served again
    while (r := httpx.get(f"{url}/v1/models", timeout=30)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    refused = [line for line in metrics.splitlines()
               if line.startswith('pdserve_connection_refusals_total{reason="max_connections"}')]
    assert refused and float(refused[0].split()[-1]) >= 1, refused
