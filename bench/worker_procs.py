"""Start and stop worker processes for benchmarks (one core each, bounded waits, no orphans)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

READY_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerProc:
    role: str
    address: str
    proc: subprocess.Popen
    log_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_worker(role: str, model: str, dtype: str, core: int | None, worker_id: str, log_dir: str,
                 extra: list[str] = ()) -> WorkerProc:
    """`python -m <role>` pinned to `core`; returns once it printed its ready line."""
    port = free_port()
    cmd = [sys.executable, "-m", role, "--model", model, "--dtype", dtype, "--port", str(port),
           "--worker-id", worker_id, "--threads", "1", *extra]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    log_path = os.path.join(log_dir, f"{role}-{worker_id}.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} worker exited with {proc.returncode}; see {log_path}")
        with open(log_path) as f:
            if " ready on " in f.read():
                return WorkerProc(role, f"127.0.0.1:{port}", proc, log_path)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{role} worker not ready after {READY_TIMEOUT_S}s; see {log_path}")
