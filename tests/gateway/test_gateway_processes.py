"""Several gateway processes on one port (`python -m gateway --processes 2`): a tenant's
limit holds across them exactly, a child killed while it serves is restarted with its
slots given back, /metrics from either child counts what both served, and a membership
push that one child takes reaches the other.

The kernel hands each connection to one child, so every test maps its connections to the
child that accepted them (`serving_process`) and proves each claim from both children's
sides. The decode worker's steps last at least STEP_S, so a stream is still running
while a test holds it (it ends when the test closes its connection)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from bench.harness.gateway_procs import admin_gateway, metric_value, serving_process
from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import WorkerProc, start_workers, wait_until
from common import envs
from gateway import processes
from gateway.errors import APIError
from gateway.tenant_table import TenantTable
from gateway.tenants import Tenant, Tenants

TOKEN = "admin-token-for-the-processes-test"
STEP_S = 0.1  # the decode workers' slowest step: a 480-token stream runs 48 s unless closed
NO_EOS = {"0": -100, "2": -100}  # the end-of-text ids of the tokenizer (SmolLM2's) and of the tiny config
LONG = {"model": "smollm2", "prompt": [5, 6, 7, 8], "max_tokens": 480, "stream": True, "logit_bias": NO_EOS}
SHORT = {"model": "smollm2", "prompt": [5, 6, 7, 8], "max_tokens": 2, "logit_bias": NO_EOS}
LIMIT = 4  # tenant a's max_concurrent


def test_the_shared_table_sums_every_process_column_and_a_zeroed_column_frees_its_slots(tmp_path):
    """Two processes' views of one tenant (two handles on one table, as two children have):
    each checks the sum of both columns, releases its own, and the front process's zeroing
    of one column gives back exactly what that process held."""
    front = TenantTable.create(tmp_path / "counts", rows=3, processes=2)  # anonymous, a, the retry budget

    def tenant_of(process: int) -> Tenant:
        tenants = Tenants({"key": Tenant("a", max_concurrent=4, max_queued_tokens=100)})
        tenants.share(TenantTable.open(tmp_path / "counts", 3, 2, process))
        return tenants.by_key["key"]

    first, second = tenant_of(0), tenant_of(1)
    first.admit(10, choices=3)
    second.admit(20)
    for tenant in (first, second):
        with pytest.raises(APIError) as refused:
            tenant.admit(1)
        assert refused.value.status == 429 and "4 concurrent sequences" in refused.value.message
    assert (first.in_flight, second.in_flight) == (3, 1)  # each process's own share
    first.release(10, choices=3)
    with pytest.raises(APIError, match="100 tokens in flight"):
        first.admit(81)  # the other process's 20 + 81
    first.admit(80)
    front.zero_column(0)  # process 0 died: its 1 sequence and 80 tokens are free
    second.admit(80, choices=3)
    with pytest.raises(APIError):
        second.admit(1)
    second.release(100, choices=4)
    assert first.shared.totals() == (0, 0)


def test_the_shared_folder_is_in_the_run_folder_and_a_killed_front_process_leaves_none(tmp_path, monkeypatch):
    """A front process killed with SIGKILL never removed its folder: the next start on the
    host does, and leaves a live front process's alone."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    run = envs.run_dir()
    run.mkdir(parents=True)
    orphan, live = run / f"gateway-{dead.pid}-abc", run / f"gateway-{os.getppid()}-abc"
    for folder in (orphan, live):
        folder.mkdir()
        (folder / "tenants.json").write_text("{}")
    folder, table = processes.make_folder(None, 2)
    try:
        assert folder.path.parent == run and folder.path.name.startswith(f"gateway-{os.getpid()}-")
        assert not orphan.exists() and live.exists()
    finally:
        table.close()
        shutil.rmtree(folder.path)


@dataclass
class Deployment:
    url: str
    admin: str
    front: object  # the front process (subprocess.Popen)
    decode: WorkerProc
    model: Path  # the tiny model's folder
    logs: Path

    def children(self) -> set[int]:
        return {p.pid for p in psutil.Process(self.front.pid).children()}


@pytest.fixture(scope="module")
def deployment(smollm2_dir, tmp_path_factory):
    """A front process with two gateway processes, an admin socket and tenants a (at most
    LIMIT sequences) and b (what the pool holds), over one slow decode worker."""
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway tokenizes; prompts here are ids < 320
        shutil.copy(smollm2_dir / name, model / name)
    logs = tmp_path_factory.mktemp("processes-logs")
    (logs / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "a", "api_keys": ["key-a"], "max_concurrent": LIMIT},
        {"name": "b", "api_keys": ["key-b"]},
    ]}))
    (decode,) = start_workers([_slow_decode()], model, logs)
    started = []
    try:
        with admin_gateway(model, [decode.address], [], logs / "gateway.log", TOKEN, "--tenants",
                           str(logs / "tenants.json"), "--max-ttft", "inf", processes=2, started=started) as (url, _):
            (front,) = started
            m = re.search(r"^admin on (\S+):(\d+)$", (logs / "gateway.log").read_text(), re.MULTILINE)
            d = Deployment(url, f"http://{m.group(1)}:{m.group(2)}", front, decode, model, logs)
            wait_until(lambda: len(d.children()) == 2, 30, "two gateway processes")
            cmdline = psutil.Process(min(d.children())).cmdline()
            folder = Path(cmdline[cmdline.index("--shared") + 1])
            assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700, folder
            # under the cache folder's run/, not /tmp: a tmp cleaner would take tenants.json from a later restart
            assert folder.parent == envs.run_dir() and folder.name.startswith(f"gateway-{front.pid}-"), folder
            yield d
        # both children ended cleanly, and the front process by the signal, as a lone gateway does
        assert front.returncode == -signal.SIGTERM, (logs / "gateway.log").read_text()[-3000:]
        assert not folder.exists(), "the shared folder outlived the front process"
    finally:
        decode.stop()


def _slow_decode():
    return ("decode", ["--dtype", "float32", "--kv-blocks", "2048", "--no-transfer"],
            {"PDSERVE_FAULT_STEP_FLOOR_S": str(STEP_S)})


# --- raw HTTP, so each request's connection can be mapped to the process that took it ---

def _send(url: str, method: str, path: str, body: dict | None = None, key: str | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode() if body is not None else b""
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{auth}"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def _head(conn: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, head, what came after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, rest


def _answer(conn: socket.socket) -> tuple[int, bytes]:
    """A whole response with a Content-Length: (status, body)."""
    status, head, body = _head(conn)
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return status, body


def _open_stream(d: Deployment, key: str) -> tuple[socket.socket, int, int]:
    """A long stream: (its connection, the response status, the process that took it). At
    a 200 the tenant's slot is held (taken before the head is sent)."""
    conn = _send(d.url, "POST", "/v1/completions", LONG, key)
    status, _, _ = _head(conn)
    return conn, status, serving_process(d.front, conn)


def _streams_on_both(d: Deployment, key: str, n: int) -> list[tuple[socket.socket, int]]:
    """n streams held open, each on its own connection, at least one on each process (a
    last stream that would leave a process without one is closed and opened again)."""
    held: list[tuple[socket.socket, int]] = []
    deadline = time.monotonic() + 60
    while len(held) < n:
        assert time.monotonic() < deadline, f"could not open {n} streams over both processes: {held}"
        conn, status, pid = _open_stream(d, key)
        covered = {p for _, p in held} | {pid}
        if status != 200 or (len(held) == n - 1 and covered != d.children()):
            conn.close()  # a slot a closed stream gave back may take a moment to free
            time.sleep(0.1)
            continue
        held.append((conn, pid))
    return held


def _close(held) -> None:
    for conn, _ in held:
        conn.close()


def _on_each_process(d: Deployment, attempt, timeout_s: float = 60) -> dict[int, object]:
    """`attempt()` -> (connection, result) until each process has answered one (a process
    just restarted may take a while to start accepting); {pid: result}."""
    answers: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        conn, result = attempt()
        with contextlib.closing(conn):
            answers.setdefault(serving_process(d.front, conn), result)
        if set(answers) >= d.children():
            return answers
        assert time.monotonic() < deadline, f"only processes {sorted(answers)} of {sorted(d.children())} answered"
        time.sleep(0.02)


def _refused_at_the_limit(d: Deployment) -> dict[int, object]:
    def one_more():
        conn = _send(d.url, "POST", "/v1/completions", SHORT, "key-a")
        status, body = _answer(conn)
        return conn, (status, json.loads(body)["error"]["code"] if status != 200 else None)

    return _on_each_process(d, one_more)


def _limit_back(d: Deployment) -> list[tuple[socket.socket, int]]:
    """LIMIT streams of tenant a open again (each may wait a moment for a slot a closed
    stream gives back; a slot that never comes back fails the wait)."""
    return _streams_on_both(d, "key-a", LIMIT)


def test_a_tenant_limit_holds_across_the_processes(deployment):
    """Tenant a holds LIMIT streams, spread over both processes, so neither holds LIMIT
    itself: one more request is refused 429 by whichever process takes it. Once the streams
    end, LIMIT run again."""
    d = deployment
    held = _streams_on_both(d, "key-a", LIMIT)
    try:
        per_process = {pid: sum(p == pid for _, p in held) for pid in d.children()}
        assert all(0 < count < LIMIT for count in per_process.values()), per_process
        refused = _refused_at_the_limit(d)
        assert set(refused.values()) == {(429, "tenant_concurrency_limit")}, refused
    finally:
        _close(held)
    _close(_limit_back(d))


def test_a_killed_process_is_restarted_and_its_slots_come_back(deployment):
    """kill -9 of a process while it holds tenant a's streams: its clients' connections end,
    the front process starts another in its place, and the slots the dead one held are free
    again (its column of the shared counts zeroed): LIMIT streams run, not fewer, and one
    more is refused. The port answers throughout."""
    d = deployment
    held = _streams_on_both(d, "key-a", LIMIT)
    victim = held[0][1]
    lost = [conn for conn, pid in held if pid == victim]
    kept = [(conn, pid) for conn, pid in held if pid != victim]
    more: list[tuple[socket.socket, int]] = []
    try:
        os.kill(victim, signal.SIGKILL)
        for conn in lost:  # the dead process's streams end for their clients
            conn.settimeout(30)
            with contextlib.suppress(ConnectionResetError):
                while conn.recv(65536):
                    pass
        assert httpx.get(f"{d.url}/health", timeout=30).status_code == 200
        wait_until(lambda: len(d.children()) == 2 and victim not in d.children(), 60, "a process in the dead one's place")
        deadline = time.monotonic() + 60
        while len(more) < len(lost):  # the dead one's slots, back
            assert time.monotonic() < deadline, "the killed process's tenant slots never came back"
            conn, status, pid = _open_stream(d, "key-a")
            if status == 200:
                more.append((conn, pid))
            else:
                conn.close()
                time.sleep(0.2)
        refused = _refused_at_the_limit(d)  # both processes, the new one included, see the limit
        assert set(refused.values()) == {(429, "tenant_concurrency_limit")}, refused
    finally:
        _close(kept + more + [(conn, 0) for conn in lost])
    assert "exited with -9; its tenant counts are zeroed" in (d.logs / "gateway.log").read_text()
    _close(_limit_back(d))


def test_metrics_from_either_process_count_what_both_served(deployment):
    """Requests served by both processes, then /metrics asked of each: every answer counts
    every request (its counters are the sum over the processes)."""
    d = deployment
    scrape = lambda: httpx.get(f"{d.url}/metrics", timeout=30).text  # noqa: E731
    before = scrape()
    served: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(served) < 2 or min(served.values()) < 2:
        assert time.monotonic() < deadline, f"requests served by one process only: {served}"
        conn = _send(d.url, "POST", "/v1/completions", SHORT, "key-b")
        with contextlib.closing(conn):
            status, body = _answer(conn)
            assert status == 200, body
            pid = serving_process(d.front, conn)
        served[pid] = served.get(pid, 0) + 1
    sent = sum(served.values())

    def scraped():
        conn = _send(d.url, "GET", "/metrics")
        status, body = _answer(conn)
        assert status == 200
        return conn, body.decode()

    for pid, text in _on_each_process(d, scraped).items():
        for name, labels, per_request in (("pdserve_requests_total", {"endpoint": "completions", "status": "ok"}, 1),
                                          ("pdserve_prompt_tokens_total", {}, len(SHORT["prompt"]))):
            grew = metric_value(text, name, **labels) - metric_value(before, name, **labels)
            assert grew == sent * per_request, (pid, name, grew, served)
        assert "pdserve_worker_kv_blocks_total{worker=" in text, pid  # the workers' gauges, from its own Stats


def test_a_membership_push_reaches_every_process(deployment, tmp_path):
    """A PUT of a new decode worker to the shared admin socket reaches one process; both
    list it and route to it: streams opened through each land on the new worker alone."""
    d = deployment
    auth = {"Authorization": f"Bearer {TOKEN}"}
    (new,) = start_workers([_slow_decode()], d.model, tmp_path)
    held: list[tuple[socket.socket, int]] = []

    def push(decode: str) -> None:
        pushed = httpx.put(f"{d.admin}/admin/workers", json={"decode": [decode], "prefill": []}, headers=auth,
                           timeout=10)
        assert pushed.status_code == 200, pushed.text

    def listed():
        conn = _send(d.admin, "GET", "/admin/workers", key=TOKEN)
        status, body = _answer(conn)
        assert status == 200, body
        return conn, [w["address"] for w in json.loads(body)["decode"]]

    try:
        push(new.address)
        wait_until(lambda: set(map(tuple, _on_each_process(d, listed).values())) == {(new.address,)}, 30,
                   "both processes to list the new worker")
        held = _streams_on_both(d, "key-b", 2)
        wait_until(lambda: new.stats().running_requests == 2, 30, "both streams on the new worker")
        assert d.decode.stats().running_requests == 0
    finally:
        _close(held)
        push(d.decode.address)
        new.stop()
