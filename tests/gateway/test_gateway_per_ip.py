"""One address cannot hold every connection slot with requests it never finishes sending:
past `--max-connections-per-ip` connections still in their head or body, a new connection
from that address gets 429 and is closed, while other addresses are served as before and
the address is served again once its slow connections end."""

from __future__ import annotations

import socket

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import wait_until
from gateway.per_ip_cap import PerIpCap

CAP = 3
OTHER_IP = "127.0.0.2"  # loopback too (127.0.0.0/8): a second client address on one host


def test_the_cap_counts_each_address_apart_and_gives_back_what_leaves():
    cap = PerIpCap(2)
    assert cap.enter("a") and cap.enter("a") and not cap.enter("a")
    assert cap.enter("b")  # another address is not held back by the first
    cap.leave("a")
    assert cap.enter("a") and not cap.enter("a")
    for ip in ("a", "a", "b"):
        cap.leave(ip)
    assert cap.held() == 0  # nothing left behind


def _slow_body(host: str, port: int) -> socket.socket:
    """A connection that sent a request head and part of its body, and sends no more."""
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
              "content-length: 1000\r\n\r\n{\"model\": ".encode())
    return s


def _answer(s: socket.socket) -> bytes:
    """What the server sends until it closes (a bound of 30 s, not a speed)."""
    s.settimeout(30)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


def _request(url: str, local_address: str) -> httpx.Response:
    """A whole request from `local_address` (the gateway answers /v1/models itself)."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=local_address), timeout=30) as c:
        return c.get(f"{url}/v1/models")


@pytest.fixture(scope="module")
def url(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("per_ip") / "gateway.log"
    # a body timeout longer than any wait here: the slow bodies are still being sent throughout
    with gateway(smollm2_dir, ["127.0.0.1:1"], [], log, "--max-connections-per-ip", str(CAP),
                 "--body-timeout", "600") as url:
        yield url


def _refused_at_the_cap_while_others_are_served(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as extra:
        answer = _answer(extra)
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    assert f"(limit {CAP})".encode() in answer and b'"error"' in answer, answer
    refused = _request(url, "127.0.0.1")
    assert refused.status_code == 429 and f"limit {CAP}" in refused.json()["error"]["message"], refused.text
    other = _request(url, OTHER_IP)
    assert other.status_code == 200 and other.json()["data"][0]["id"] == "smollm2", other.text


def _served_again(url: str) -> None:
    """The slow connections ended: the address has its slots back (nothing left counted)."""
    wait_until(lambda: _request(url, "127.0.0.1").status_code == 200, 30, "the address served again")


def test_one_address_past_its_cap_of_unfinished_connections_is_refused_and_others_are_served(url):
    _served_again(url)  # the gateway's own start-up polls hold nothing
    host, port = url.removeprefix("http://").split(":")
    slow = [_slow_body(host, int(port)) for _ in range(CAP)]
    try:
        _refused_at_the_cap_while_others_are_served(url)
    finally:
        for s in slow:
            s.close()
    _served_again(url)


def test_a_keep_alive_connection_counts_again_once_its_next_request_starts(url):
    """A served request leaves the count; the first bytes of the next one on the same
    connection bring it back, so reused connections cannot get round the cap."""
    _served_again(url)
    host, port = url.removeprefix("http://").split(":")
    reused = []
    try:
        for _ in range(CAP):
            s = socket.create_connection((host, int(port)), timeout=10)
            reused.append(s)
            s.sendall(f"GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
            first = b""
            while not first.endswith(b"}"):
                first += s.recv(4096)
            assert first.startswith(b"HTTP/1.1 200"), first[:200]
        assert _request(url, "127.0.0.1").status_code == 200  # idle keep-alive connections do not count
        for s in reused:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-length: 1000\r\n\r\n{{".encode())
        wait_until(lambda: _request(url, "127.0.0.1").status_code == 429, 30, "the reused connections counted")
        _refused_at_the_cap_while_others_are_served(url)
    finally:
        for s in reused:
            s.close()
    _served_again(url)
