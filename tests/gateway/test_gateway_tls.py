"""TLS on the gateway's client port (`--ssl-certfile` / `--ssl-keyfile`): the official
openai client streams a chat completion over https from a real deployment, plain HTTP on
that port gets no answer, every gateway process of `--processes 2` serves TLS, and a
certificate that cannot be loaded stops the gateway at start naming it."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from bench.harness.certificates import self_signed
from bench.harness.gateway_procs import CHAT
from bench.harness.worker_procs import REPO, free_port


@pytest.fixture(scope="module")
def tls(system, smollm2_dir, tmp_path_factory):
    """A TLS gateway of two processes over the shared deployment's workers: (url, cert)."""
    _, prefill, decode = system
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(folder)
    port = free_port()
    log = folder / "gateway.log"
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--served-name", "smollm2",
                           "--port", str(port), "--decode", decode.address, "--prefill", prefill.address,
                           "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--processes", "2"],
                          cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/ready", verify=str(cert), timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gw.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        yield url, cert
    finally:
        gw.terminate()
        gw.wait(10)


def test_the_openai_client_streams_over_https(tls):
    url, cert = tls
    client = OpenAI(base_url=f"{url}/v1", api_key="none", http_client=httpx.Client(verify=str(cert)))
    for _ in range(4):  # connections land on either gateway process: each speaks TLS
        stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0,
                                                stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text.strip(), text


def test_plain_http_on_the_tls_port_gets_no_answer(tls):
    url, _ = tls
    host, port = url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
        s.settimeout(10)
        try:
            answer = s.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:100]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{host}:{port}/health", timeout=10)
    with pytest.raises(ssl.SSLCertVerificationError):  # and a client that checks certificates trusts only the one
        with socket.create_connection((host, int(port)), timeout=10) as s:
            ssl.create_default_context().wrap_socket(s, server_hostname="localhost")


def test_a_certificate_that_cannot_be_loaded_stops_the_gateway_at_start(smollm2_dir, tmp_path):
    cert, _ = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")  # a key of another certificate
    ran = subprocess.run([sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--decode", "127.0.0.1:1",
                          "--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and "cannot load them" in ran.stderr and str(cert) in ran.stderr, ran.stderr[-2000:]
