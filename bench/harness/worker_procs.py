"""Real `python -m prefill` / `python -m decode` processes, for the tests and the benchmarks.

`start_workers` launches worker processes on OS-chosen loopback ports (`--port 0`; the
bound port is read back from the "ready on HOST:PORT" line of the log), all at once so
their start-ups overlap, each pinned to a core if its spec names one, and waits a bounded
time for each to be ready. A worker that exits or stays silent raises with the tail of
its log, after every worker started with it is stopped. Every wait here is bounded, and
`WorkerProc.stop` (terminate, then kill) always ends the process.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0
_READY = re.compile(r" ready on (\S+):(\d+)$", re.MULTILINE)


def free_port() -> int:
    """A loopback port free now, for a process that must be told its port up front."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerSpec(NamedTuple):
    """One worker to start: its role, extra arguments and environment, and its core."""

    role: str  # "prefill" or "decode"
    args: Sequence[str] = ()
    env: Mapping[str, str] = {}
    core: int | None = None  # pinned there with taskset; None: any core


class Stubs:
    """One channel's stubs: the role's own service first, then the Worker service."""

    def __init__(self, channel: grpc.Channel, role: str):
        role_stub = pb_grpc.DecodeWorkerStub if role == "decode" else pb_grpc.PrefillWorkerStub
        self._stubs = (role_stub(channel), pb_grpc.WorkerStub(channel))

    def __getattr__(self, name: str):
        for stub in self._stubs:
            if hasattr(stub, name):
                return getattr(stub, name)
        raise AttributeError(name)


@dataclass
class WorkerProc:
    role: str  # "prefill" or "decode"
    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    _channel: grpc.Channel | None = None

    @property
    def stub(self) -> Stubs:
        """The role's service and the shared Worker service (Health, Stats, TransferInfo)."""
        if self._channel is None:
            self._channel = auth.channel(self.address)
        return Stubs(self._channel, self.role)

    def stats(self, timeout: float = 5.0) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def name(self) -> str:
        """Its name (role-worker_id-incarnation), as its Stats and the gateway's headers give it."""
        return self.stats().worker

    def kill(self) -> None:
        """SIGKILL, no clean-up on the worker's side (a crash)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(8)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


_WORKER_IDS = itertools.count()  # every worker of a process in a slot of its own

def _launch(spec: WorkerSpec, model: str, log_path: Path) -> WorkerProc:
    cmd = [sys.executable, "-m", spec.role, "--model", model, "--port", "0", "--threads", "1", *spec.args]
    if "--worker-id" not in spec.args:
        # Its own slot: a worker with another's id is that worker's newer incarnation to the
        # prefill workers it meets (which then refuse the older one), as in a deployment.
        cmd += ["--worker-id", str(next(_WORKER_IDS))]
    if spec.core is not None:
        cmd = ["taskset", "-c", str(spec.core), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **spec.env}
    with open(log_path, "wb") as log:  # a file, not a pipe: a chatty worker never blocks on it
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return WorkerProc(spec.role, proc, log_path)


def _wait_ready(workers: list[WorkerProc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    while pending:
        for w in list(pending):
            m = _READY.search(w.log_path.read_text(errors="replace"))
            if m:
                w.address = f"{m.group(1)}:{m.group(2)}"
                pending.remove(w)
            elif not w.alive():
                raise RuntimeError(f"{w.role} worker exited with {w.proc.returncode} before it was ready "
                                   f"(log {w.log_path}):\n{w.log_tail()}")
        if pending and time.monotonic() > deadline:
            w = pending[0]
            raise RuntimeError(f"{w.role} worker not ready within {timeout_s}s (log {w.log_path}):\n{w.log_tail()}")
        time.sleep(0.05)


def start_workers(specs: Sequence[WorkerSpec | tuple], model: str | Path, log_dir: str | Path,
                  timeout_s: float = READY_TIMEOUT_S) -> list[WorkerProc]:
    """Start one worker per spec (a WorkerSpec, or a tuple of its fields: role, extra args,
    extra env[, core]) and wait until all are ready; their logs go to `log_dir`.

    On any failure every worker started here is stopped before the error propagates.
    """
    workers: list[WorkerProc] = []
    try:
        for i, spec in enumerate(specs):
            spec = WorkerSpec(*spec)
            log_path = Path(log_dir) / f"{spec.role}-{i}-{time.monotonic_ns()}.log"
            workers.append(_launch(spec, str(model), log_path))
        _wait_ready(workers, timeout_s)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def wait_idle(worker: WorkerProc, timeout_s: float = 20.0) -> pb.StatsResponse:
    """Poll Stats until no request is queued or running and every block is free (bounded).

    Returns the last Stats; the caller asserts on it, so a leak shows its numbers.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        s = worker.stats()
        if s.waiting_requests == 0 and s.running_requests == 0 and s.free_blocks == s.total_blocks:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def wait_until(check, timeout_s: float, what: str) -> None:
    """Poll `check` until it is true; an AssertionError naming `what` past the timeout."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.002)
