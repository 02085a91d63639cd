"""One address cannot hold every connection slot with requests it never finishes sending:
past `--max-connections-per-ip` stalled connections (still in their head or body past a
short grace), one more from that address gets a JSON 429 it can read and is closed, while
its fast requests and other addresses are served as before, and the address's slots come
back once its slow connections end. A burst of a thousand fast streams from one address is
served whole; behind a trusted proxy the address its X-Forwarded-For names is the one counted."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from bench.harness.sse_streams import open_streams
from bench.harness.worker_procs import start_workers, wait_until
from gateway.front_door.per_ip_cap import PerIpCap
from gateway.front_door.trusted_proxies import TrustedProxies

CAP = 3
OTHER_IP = "127.0.0.2"  # loopback too (127.0.0.0/8): a second client address on one host
# Documentation addresses (TEST-NET-2): clients a trusted proxy names in X-Forwarded-For
BEHIND_A, BEHIND_B = "198.51.100.7", "198.51.100.8"
BURST = 1000  # streams opened at once from one address, on a gateway with the default caps (1,024 / 256)


def test_the_cap_counts_each_address_apart_and_gives_back_what_leaves():
    cap = PerIpCap(2)
    assert cap.enter("a") and cap.enter("a") and not cap.enter("a")
    assert cap.enter("b")  # another address is not held back by the first
    cap.leave("a")
    assert cap.enter("a") and not cap.enter("a")
    for ip in ("a", "a", "b"):
        cap.leave(ip)
    assert cap.held() == 0  # nothing left behind


def test_trusted_proxies_name_the_client_and_nobody_else_does():
    none = TrustedProxies("")
    assert not none and none.client("127.0.0.1", [(b"x-forwarded-for", BEHIND_A.encode())]) == "127.0.0.1"
    proxies = TrustedProxies("127.0.0.1, 10.0.0.0/8")
    hops = [(b"x-forwarded-for", f"1.2.3.4, {BEHIND_A}, 10.1.1.1".encode())]
    # the right-most hop no trusted proxy wrote: what the client put first is not believed
    assert proxies.client("127.0.0.1", hops) == BEHIND_A
    assert proxies.client(BEHIND_B, hops) == BEHIND_B  # from a peer that is no trusted proxy: the peer
    assert proxies.client("127.0.0.1", []) == "127.0.0.1"
    assert TrustedProxies("*").trusts(BEHIND_B)
    with pytest.raises(ValueError, match="not-an-address"):
        TrustedProxies("127.0.0.1,not-an-address")


def _slow_body(host: str, port: int, forwarded_for: str | None = None) -> socket.socket:
    """A connection that sent a request head and part of its body, and sends no more."""
    s = socket.create_connection((host, port), timeout=10)
    xff = f"x-forwarded-for: {forwarded_for}\r\n" if forwarded_for else ""
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{xff}"
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
    # a head deadline past the grace (2 s), so a connection that sends nothing stalls first
    with gateway(smollm2_dir, ["127.0.0.1:1"], [], log, "--max-connections-per-ip", str(CAP),
                 "--body-timeout", "600", "--header-timeout", "4", "--forwarded-allow-ips", "127.0.0.2") as url:
        yield url


def _refused(answer: bytes, ip: str = "127.0.0.1") -> None:
    """A JSON 429 naming the cap and the address, read whole (never a bare close), whose
    Retry-After is when the address's first stalled connection is cut off at the latest:
    here its body's whole deadline (--body-timeout 600 plus 1 MiB at 16 KiB/s), not a constant."""
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    retry_after = int(answer.split(b"retry-after: ")[1].split(b"\r\n")[0])
    assert 600 <= retry_after <= 600 + 64, retry_after
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "too_many_connections", body
    assert f"(limit {CAP})" in body["error"]["message"] and ip in body["error"]["message"], body


def _refused_at_the_cap_while_others_are_served(url: str) -> None:
    """The address's stalled connections are at the cap: one more that stalls (it sends
    nothing) is refused once its grace runs out; its fast requests, and other addresses',
    are served meanwhile."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as extra:
        fast = _request(url, "127.0.0.1")  # sent whole at once: never stalled, never counted
        assert fast.status_code == 200 and fast.json()["data"][0]["id"] == "smollm2", fast.text
        other = _request(url, OTHER_IP)
        assert other.status_code == 200, other.text
        _refused(_answer(extra))


def _served_again(url: str) -> None:
    """The slow connections ended: the address has its slots back (nothing left counted):
    a connection that stalls is counted, not refused (it gets the 408 of its head deadline)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        answer = _answer(idle)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_one_address_past_its_cap_of_stalled_connections_is_refused_and_others_are_served(url):
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
        for s in reused:  # idle keep-alive connections do not count; their next requests stall
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-length: 1000\r\n\r\n{{".encode())
        _refused_at_the_cap_while_others_are_served(url)
    finally:
        for s in reused:
            s.close()
    _served_again(url)


def test_behind_a_trusted_proxy_the_forwarded_address_is_counted(url):
    """127.0.0.2 is a trusted proxy here: its stalled bodies count against the client each
    names, so one client behind it is capped and another behind it is not."""
    host, port = url.removeprefix("http://").split(":")

    def via_proxy(forwarded_for: str) -> socket.socket:
        s = socket.socket()
        s.bind((OTHER_IP, 0))
        s.connect((host, int(port)))
        s.settimeout(10)
        xff = f"x-forwarded-for: {forwarded_for}\r\n"
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n{xff}content-length: 1000\r\n\r\n{{".encode())
        return s

    held = [via_proxy(BEHIND_A) for _ in range(CAP)]
    try:
        with via_proxy(BEHIND_A) as over, via_proxy(BEHIND_B) as other:
            _refused(_answer(over), BEHIND_A)
            other.settimeout(1.0 + 2.0)  # past the grace: counted, not refused, still open
            with pytest.raises(TimeoutError):
                other.recv(1)
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="module")
def burst_url(smollm2_dir, tmp_path_factory):
    """A gateway with the default caps (1,024 connections, 256 stalled per address) over a
    decode worker that holds BURST requests (64 running, the rest queued)."""
    logs = tmp_path_factory.mktemp("burst")
    [decode] = start_workers([("decode", ["--dtype", "float32", "--no-transfer", "--max-num-seqs", "64",
                                          "--max-waiting", "1024", "--kv-blocks", "1200"], {})],
                             smollm2_dir, logs, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [], logs / "gateway.log", "--max-ttft", "3600") as url:
            assert httpx.get(f"{url}/ready", timeout=60).json() == {"ready": True}  # it knows the pool's size
            yield url
    finally:
        decode.stop()


def test_a_burst_of_streams_from_one_address_is_served_whole(burst_url):
    """BURST streams opened at once from one address (every client behind a proxy has one):
    none counted (each sent its request at once), so every one is answered to its [DONE]."""
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "stream": True, "ignore_eos": True,
            "temperature": 0}
    streams = asyncio.run(open_streams(burst_url, BURST, "/v1/completions", body, local_address="127.0.0.1"))
    failed = [s.error for s in streams if s.error or not s.done]
    assert not failed, f"{len(failed)} of {BURST} not served, e.g. {failed[:3]}"
    assert all(s.tokens == 2 for s in streams), sorted({s.tokens for s in streams})
