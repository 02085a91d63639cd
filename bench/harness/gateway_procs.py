"""A real gateway process (`python -m gateway` over given workers), and the helpers the
gateway tests share; the tests' shared deployment (`system`: one prefill and one decode
worker of SmolLM2 in float32 behind a gateway) is a session fixture in tests/conftest.py."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import psutil

from bench.harness.worker_procs import REPO, free_port
from gateway.front_door.head_deadline import CLIENT_KEEPALIVE_EXPIRY_S

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# The flood's client expires idle connections before the gateway closes them, as any client
# of it should: one reused just as the gateway's keep-alive ends gets a ReadError.
FLOOD_LIMITS = httpx.Limits(max_connections=100, keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)


@contextlib.contextmanager
def gateway(model_dir, decode: list[str], prefill: list[str], log_path, *extra: str, processes: int = 1,
            started: list[subprocess.Popen] | None = None, env: dict[str, str] | None = None):
    """A `python -m gateway` process over the given workers; yields its URL once /health
    answers. `processes` > 1: that many gateway processes on the port, under a front process
    (gateway/processes.py); `started` gets the (front) process, for tests that need its pid;
    `env`: variables set for it beside this process's."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "--model", str(model_dir), "--served-name", "smollm2", "--port", str(port)]
    cmd += [a for d in decode for a in ("--decode", d)] + [a for p in prefill for a in ("--prefill", p)]
    if processes != 1:
        cmd += ["--processes", str(processes)]
    gw = subprocess.Popen([*cmd, *extra], cwd=REPO, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                          env={**os.environ, **env} if env else None)
    if started is not None:
        started.append(gw)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gw.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.1)
        yield url
    finally:
        gw.terminate()
        gw.wait(10)


@contextlib.contextmanager
def admin_gateway(model_dir, decode: list[str], prefill: list[str], log_path, token: str, *extra: str,
                  processes: int = 1, started: list[subprocess.Popen] | None = None):
    """`gateway` with an admin socket (PDSERVE_ADMIN_TOKEN=token), as the deploy controller
    runs it; yields (its URL, a function that PUTs a new membership: decode, prefill)."""
    os.environ["PDSERVE_ADMIN_TOKEN"] = token
    try:
        with gateway(model_dir, decode, prefill, log_path, *extra, processes=processes, started=started) as url:
            deadline = time.monotonic() + 30
            while not (m := re.search(r"^admin on (\S+):(\d+)$", log_path.read_text(), re.MULTILINE)):
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.1)
            admin = f"http://{m.group(1)}:{m.group(2)}"

            def members(decode: list[str], prefill: list[str]) -> None:
                resp = httpx.put(f"{admin}/admin/workers", json={"decode": decode, "prefill": prefill},
                                 headers={"Authorization": f"Bearer {token}"}, timeout=10)
                assert resp.status_code == 200, resp.text

            yield url, members
    finally:
        del os.environ["PDSERVE_ADMIN_TOKEN"]


def serving_process(front: subprocess.Popen, conn: socket.socket, timeout_s: float = 10.0) -> int:
    """The pid of the gateway process, under the front process `front` (`--processes N`),
    that accepted `conn` (a client's connection to the client or the admin socket)."""
    server_port, client_port = conn.getpeername()[1], conn.getsockname()[1]
    deadline = time.monotonic() + timeout_s
    while True:
        for child in psutil.Process(front.pid).children():
            try:
                held = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.raddr and c.raddr.port == client_port and c.laddr.port == server_port for c in held):
                return child.pid
        assert time.monotonic() < deadline, f"no gateway process holds the connection from port {client_port}"
        time.sleep(0.02)


def data_lines(lines):
    return (line for line in lines if line.startswith("data: "))


def metric_value(metrics: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = next((ln for ln in metrics.splitlines() if ln.startswith(f"{name}{{{want}}}" if want else f"{name} ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def raw_post(url: str, head: dict[str, str], body_parts: list[bytes], finish: bool) -> bytes:
    """POST by hand: the head, then each part as a chunk (chunked encoding), the closing
    chunk only if `finish`; returns what the server answered within 10 s (b"" if nothing)."""
    host, port = url.removeprefix("http://").split(":")
    lines = ["POST /v1/completions HTTP/1.1", f"host: {host}", "transfer-encoding: chunked",
             "content-type: application/json", *(f"{k}: {v}" for k, v in head.items())]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for part in body_parts:
                s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            if finish:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed before taking it all: what we want
            pass
        data = b""
        while True:  # until the whole answer (its Content-Length) is in, the server closes, or 10 s pass
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return data
            data += chunk
            head, sep, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if not chunk or (sep and length and len(rest) >= int(length.group(1))):
                return data
