"""A request head has a deadline (--header-timeout): a client that sends its headers byte by
byte, or opens a connection and sends nothing, is answered 408 and cut off, while a client
that sends a whole head in time is served on the same kind of connection."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import pytest

from bench.harness.gateway_procs import gateway


@pytest.fixture(scope="module")
def url(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("head") / "gateway.log"
    with gateway(smollm2_dir, ["127.0.0.1:1"], [], log, "--header-timeout", "1", "--body-timeout", "1") as url:
        yield url


def _connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def _read_until_closed(sock: socket.socket, trickle: bytes = b"", limit_s: float = 30.0) -> tuple[bytes, bool]:
    """What the server sends until it closes, sending one byte of `trickle` every 0.2 s meanwhile;
    (answer, closed): closed is False if it was still open after `limit_s` (a bound, not a speed)."""
    sock.settimeout(0.2)
    answer, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if trickle:
            try:
                sock.sendall(trickle[:1])
            except OSError:
                return answer, True
            trickle = trickle[1:] or b"X"
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return answer, True
        if not chunk:
            return answer, True
        answer += chunk
    return answer, False


@pytest.mark.parametrize("trickle", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "],
                         ids=["silent", "byte-by-byte"])
def test_a_head_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(url, trickle):
    with _connect(url) as sock:
        answer, closed = _read_until_closed(sock, trickle)
    assert closed, answer
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_keep_alive_connection_gets_the_deadline_again_after_each_response(url):
    with _connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):
            first += sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        answer, closed = _read_until_closed(sock, b"GET /health HTTP/1.1\r\nX-Slow: ")
    assert closed and answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_connection_answered_before_its_body_arrived_is_closed_not_left_trickling(url):
    """A body that stopped gets its 408 (--body-timeout); the rest of that body is never
    read, so the connection closes with the answer: a client trickling on afterwards holds
    nothing (it did hold a connection, with no deadline, for as long as it kept sending)."""
    u = urlparse(url)
    with _connect(url) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100000\r\n\r\n{".encode())
        sock.settimeout(30)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        rest, closed = _read_until_closed(sock, b" " * 200, limit_s=10)
    assert closed, answer + rest

