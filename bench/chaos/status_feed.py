"""`pdserve status` held open: one Ray driver for the life of a deployment, answering each
line on its stdin with the controller's status (what `pdserve status --json` prints) as one
JSON line on its stdout: {"status": ...}, or {"error": "..."}. `StatusFeed` runs it and asks.

`pdserve status` joins the Ray cluster as a new driver on every call: about 3 s of CPU each
on a two-core host, where the chaos scenarios and the deployment tests ask for it dozens of
times (every settle, every check after a scale or a replacement), taking that CPU from the
workers under test. Joining once makes each answer an actor call.

    python -m bench.chaos.status_feed RAY_ADDRESS
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class StatusFeed:
    """The feed as a subprocess, started at the first question and asked one question at a
    time (threads may share it). Close it before the deployment stops."""

    def __init__(self, address: str, env: dict[str, str], log: Path):
        self.address, self.env, self.log = address, env, log
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def status(self, timeout_s: float = 120.0) -> dict:
        """What `pdserve status --json` prints; RuntimeError if the feed cannot say."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._close()
                with open(self.log, "ab") as log:
                    self._proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.status_feed", self.address],
                                                  cwd=REPO, env=self.env, stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, stderr=log)
            try:
                self._proc.stdin.write(b"\n")
                self._proc.stdin.flush()
                line = _read_line(self._proc.stdout, timeout_s)
            except OSError:  # it died between the question and the answer
                line = b""
            if not line:  # ended, or silent: a late answer must not be read as the next one's
                self._close(kill=True)
        answer = json.loads(line) if line else {"error": "no answer"}
        if "error" in answer:
            raise RuntimeError(f"pdserve status failed: {answer['error']}\n"
                               f"{self.log.read_text(errors='replace')[-2000:] if self.log.exists() else ''}")
        return answer["status"]

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self, kill: bool = False) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        try:
            self._proc.stdin.close()  # its loop ends; it leaves the cluster
        except OSError:
            pass
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def _read_line(pipe, timeout_s: float) -> bytes:
    """One line from `pipe` (unbuffered reads, so nothing is left in a buffer between
    questions); b"" if it ends or is silent for `timeout_s`."""
    line, deadline = b"", time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return b""
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                return b""
            line += chunk
    return line


def main(address: str) -> int:
    import ray

    from deploy.serve import CONTROLLER, NAMESPACE

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    for _ in sys.stdin:  # one line asked, one line answered; stdin closed: done
        try:
            answer = {"status": ray.get(controller.status.remote(), timeout=30)}
        except Exception as e:  # say why; the next question may be answered
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
