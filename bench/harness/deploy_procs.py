"""Helpers of the deployment tests (tests/deploy/, tests/planner/test_deploy_planner.py):
`pdserve serve` and `ray start` as processes of their own, waited on through their logs,
and checks that nothing they started outlives them. Importing this disables Ray's token
auth for every Ray process those tests start (their own loopback sandbox; the security
tests turn it back on)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from bench.harness.worker_procs import REPO, free_port

os.environ["RAY_AUTH_MODE"] = "disabled"  # every Ray process these tests start inherits it
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def process_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(procs: list[psutil.Process], timeout_s: float = 30.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, [(p.pid, " ".join(p.cmdline())[:120]) for p in alive if p.is_running()]


def wait_for(predicate, timeout_s: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        tail = log.read_text(errors="replace")[-3000:] if log else ""
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s\n{tail}"
        time.sleep(0.5)


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "pdserve"), *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def deployment_status(address: str) -> dict:
    out = pdserve("status", "--address", address, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextmanager
def serving(log: Path, *args: str, timeout_s: float = 240, env: dict[str, str] | None = None,
            prefix: tuple[str, ...] = ()):
    """`pdserve serve ARGS` (run through PREFIX, a command that execs its arguments) until it
    prints that it serves; yields (process, Ray address). On exit: SIGTERM, a clean exit
    code, and no process of its tree left."""
    proc = subprocess.Popen([*prefix, str(BIN / "pdserve"), "serve", *args], cwd=REPO, env={**ENV, **(env or {})},
                            stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "serving " in log.read_text() or proc.poll() is not None, timeout_s, "serving", log)
        assert proc.poll() is None, log.read_text()[-3000:]
        address = re.search(r"Ray cluster at (\S+)", log.read_text()).group(1)
        yield proc, address
        tree = process_tree(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        assert "pdserve: stopped" in log.read_text()
        assert_all_gone(tree)
    finally:
        if proc.poll() is None:
            for p in process_tree(proc)[::-1]:
                p.kill()


@contextmanager
def ray_head(tmp: Path, *args: str):
    """`ray start --head --block` in a temp dir of its own; yields (GCS address, dashboard URL).
    Stopping it (SIGTERM) stops what it started, checked process by process."""
    gcs, dash = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    log = tmp / "ray-head.log"
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={temp}", f"--port={gcs}",
                             "--include-dashboard=true", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                             # not the default 52365, which an embedded Ray of another test may hold
                             f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
                             *args], env=ENV, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    dashboard = f"http://127.0.0.1:{dash}"
    try:
        def up():
            try:
                return httpx.get(f"{dashboard}/api/version", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 90, "the Ray head's dashboard", log)
        yield f"127.0.0.1:{gcs}", dashboard
    finally:
        tree = process_tree(head)
        head.send_signal(signal.SIGTERM)
        head.wait(60)
        assert_all_gone(tree, 60)


@contextmanager
def ray_node(tmp: Path, gcs: str, *args: str):
    """A second Ray node on this machine (`ray start --address --block`), joined to the head
    at `gcs`; yields when it is running. Stopping it (SIGTERM) stops what it started."""
    log = tmp / "ray-node.log"
    node = subprocess.Popen([str(BIN / "ray"), "start", f"--address={gcs}", "--block",
                             f"--dashboard-agent-listen-port={free_port()}", *args], env=ENV,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "Ray runtime started" in log.read_text() or node.poll() is not None, 90, "a Ray node", log)
        assert node.poll() is None, log.read_text()[-3000:]
        yield
    finally:
        tree = process_tree(node)
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        assert_all_gone(tree, 60)
