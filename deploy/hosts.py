"""Ray actors that host pdserve's processes: one worker (`python -m deploy.role_process`,
a prefill or decode worker that can change role) or the gateway (`python -m gateway`) each.

The process is a child of the actor, not the actor itself: it keeps its own signal
handling, torch threads and NIXL agent, and its log goes to a file on its node. The child
gets PDSERVE_PARENT_PID, so when the actor dies (killed, or restarted by Ray) the child
shuts down with it; a restarted actor starts a fresh child, a new incarnation on a new
port. The controller reads `info()` every health round and notices both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ray

from common.parent_watch import ENV as PARENT_ENV
from deploy.process_log import RotatingLog, log_root
from deploy.slot import HostReport

_ADMIN = re.compile(r"^admin on (\S+):(\d+)$", re.MULTILINE)
LOG_ROOT = log_root()


class HostedProcess:
    """A child process with its log in a private, size-rotated file; `stop` always ends it."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        log = RotatingLog(log_path)
        full_env = {**os.environ, **env, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._copier = log.follow(self.proc.stdout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, and SIGKILL if it has not ended within `timeout_s` (for a worker, the
        bound its own shutdown is derived from: worker/holdings.py `shutdown_bound_s`)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=-1, max_concurrency=4)
class WorkerHost:
    """One prefill or decode worker process, bound to this node's cluster-internal address.

    The process can change role in place (deploy/role_process.py): after the controller's
    ChangeRole, `became` waits for the new worker's ready line. A host Ray restarts runs
    this constructor again, so its new process starts in the role it was first placed
    with; its report says which, and the controller changes it back (deploy/health.py)."""

    def __init__(self, role: str, worker_id: str, model: str, dtype: str, args: list[str], log_dir: str,
                 env: dict[str, str]):
        self.role, self.worker_id = role, worker_id
        self.incarnation = int(time.time() * 1000)
        self.address = ""
        threads = args[args.index("--threads") + 1] if "--threads" in args else "1"
        cmd = [sys.executable, "-m", "deploy.role_process", "--role", role, "--model", model, "--dtype", dtype,
               "--host", _node_ip(), "--port", "0", "--worker-id", worker_id, "--incarnation", str(self.incarnation),
               *args]
        log = Path(log_dir) / f"{role}-{worker_id}-{self.incarnation}.log"
        self.process = HostedProcess(cmd, log, {**env, "OMP_NUM_THREADS": threads})

    def ready(self, timeout_s: float) -> str:
        """Block until the worker prints its address; raise with its log tail if it cannot start."""
        if not self.address:
            self.address = self._wait_ready(timeout_s)
        return self.address

    def became(self, role: str, worker_id: str, incarnation: int, timeout_s: float) -> HostReport:
        """After a ChangeRole the worker accepted: wait for the new worker's ready line (its
        warm-up); raise with the log's tail if the process ended or took longer."""
        self.role, self.worker_id, self.incarnation, self.address = role, worker_id, incarnation, ""
        self.ready(timeout_s)
        return self.info()

    def _wait_ready(self, timeout_s: float) -> str:
        """The address in this incarnation's ready line: `<role>-<id>-<incarnation> ready on
        host:port` (`<role>-<id>` for a worker without a NIXL agent)."""
        deadline = time.monotonic() + timeout_s
        name = f"{re.escape(self.role)}-{re.escape(self.worker_id)}(?:-{self.incarnation})?"
        line = re.compile(rf"^{name} ready on (\S+):(\d+)$", re.MULTILINE)
        while True:
            m = line.search(self.process.log_path.read_text(errors="replace"))
            if m:
                return f"{m.group(1)}:{m.group(2)}"
            if not self.process.alive():
                raise RuntimeError(f"{self.role} worker {self.worker_id} exited with "
                                   f"{self.process.proc.returncode}:\n{self.process.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} worker {self.worker_id} not ready in {timeout_s:.0f}s:\n"
                                   f"{self.process.tail()}")
            time.sleep(0.1)

    def info(self) -> HostReport:
        return HostReport(self.address, self.process.alive(), self.process.proc.pid, os.getpid(), self.incarnation,
                          ray.get_runtime_context().get_node_id(), str(self.process.log_path), self.role,
                          self.worker_id, self.process.proc.returncode)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM; SIGKILL past `timeout_s`, the worker's shutdown bound (the controller's)."""
        return self.process.stop(timeout_s)


@ray.remote(max_restarts=-1, max_concurrency=4)
class GatewayHost:
    """The gateway process; its worker lists come from the controller (PUT /admin/workers)."""

    def __init__(self, model: str, served_name: str | None, args: list[str], admin_token: str, log_dir: str,
                 env: dict[str, str]):
        cmd = [sys.executable, "-m", "gateway", "--model", model, *args]
        if served_name:
            cmd += ["--served-name", served_name]
        self.started = time.time()
        log = Path(log_dir) / f"gateway-{int(self.started * 1000)}.log"
        self.admin_token, self.admin_address = admin_token, ""
        self.process = HostedProcess(cmd, log, {**env, "PDSERVE_ADMIN_TOKEN": admin_token})

    def push_membership(self, decode: list[str], prefill: list[str], metrics: str = "",
                        controller: str = "controller") -> str:
        """PUT the ready workers (and the controller's metrics, for the gateway's /metrics) to
        the gateway's admin socket, on this node's loopback (the only place it listens:
        gateway/front_door/admin_listener.py). Returns "" or why it failed."""
        if not self.admin_address:
            m = _ADMIN.search(self.process.log_path.read_text(errors="replace"))
            if m is None:
                return "the gateway has not opened its admin socket yet"
            self.admin_address = f"{m.group(1)}:{m.group(2)}"
        body = json.dumps({"decode": decode, "prefill": prefill, "metrics": metrics,
                           "controller": controller}).encode()
        request = urllib.request.Request(f"http://{self.admin_address}/admin/workers", data=body, method="PUT",
                                         headers={"Authorization": f"Bearer {self.admin_token}",
                                                  "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except OSError as e:  # a gateway that is (re)starting: the next round pushes again
            return str(e)
        return ""

    def info(self) -> dict:
        return {"alive": self.process.alive(), "pid": self.process.proc.pid, "host_pid": os.getpid(),
                "started": self.started, "node_id": ray.get_runtime_context().get_node_id(),
                "log": str(self.process.log_path)}

    def tail(self) -> str:
        return self.process.tail()

    def stop(self) -> int:
        return self.process.stop()
