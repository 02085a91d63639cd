"""`pdserve serve` with the chaos config, as a subprocess: start, stop, its processes,
workers, Stats and log."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import psutil
import yaml

from bench.chaos.client import until
from bench.chaos.sizes import KV_BLOCKS, MAX_OUTPUT_TOKENS, RECOVERY_TIMEOUT_S, Sizes
from bench.chaos.status_feed import StatusFeed
from common import envs
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]  # bench/chaos/deployment.py -> the repository root
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """`pdserve serve` with the chaos config, as a subprocess in a session of its own.

    `max_ttft_s` is the gateway's admission bound (None: never shed). The config names the
    internal gRPC token (and this process's environment carries it), so Stats can be read
    from every worker; PDSERVE_FAULT_STALL_FILE is set for the whole deployment (every worker
    inherits it) and names no worker until the wedge scenario writes one's name into it, and
    PDSERVE_FAULT_TRANSFER_FILE names a file that exists only while a transfer fault is on.

    `tenants` (gateway/tenants.py's entries, API keys included) is written to a tenants file
    the gateway serves with (None: open, no keys); `gateway` sets more of the deploy config's
    gateway keys (deploy/config.py GatewaySettings). `decode_replicas` decode workers of
    `decode_tp_size` ranks each (a rank is a process: `--num-cpus 4` holds 1 prefill worker
    and 3 ranks, or 2 prefill and 2 decode workers of one rank)."""

    def __init__(self, workdir: Path, sizes: Sizes, max_ttft_s: float | None = None, prefill_replicas: int = 1,
                 tenants: list[dict] | None = None, gateway: dict | None = None, decode_replicas: int = 2,
                 decode_tp_size: int = 1):
        self.workdir, self.sizes, self.max_ttft_s = workdir, sizes, max_ttft_s
        self.prefill_replicas, self.tenants, self.gateway_settings = prefill_replicas, tenants, gateway or {}
        self.decode_replicas, self.decode_tp_size = decode_replicas, decode_tp_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "serve.log"
        self.stall_file = workdir / "stall"
        self.transfer_fault_file = workdir / "transfer-fault"
        self.address = ""
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", envs.FAULT_STALL_FILE: str(self.stall_file),
                    envs.FAULT_TRANSFER_FILE: str(self.transfer_fault_file)}
        self._channels: dict[str, grpc.Channel] = {}
        self._token_before: str | None = None
        self._feed: StatusFeed | None = None  # from start to stop; its driver joins at the first question

    def config(self, token: str) -> dict:
        gateway = {"max_ttft_s": self.max_ttft_s, "max_output_tokens": MAX_OUTPUT_TOKENS, **self.gateway_settings}
        if self.tenants is not None:
            tenants = self.workdir / "tenants.json"
            tenants.write_text(json.dumps({"tenants": self.tenants}))
            gateway["tenants"] = str(tenants)
        return {"dtype": "auto", "prefill": {"replicas": self.prefill_replicas, "kv_blocks": KV_BLOCKS},
                "decode": {"replicas": self.decode_replicas, "tp_size": self.decode_tp_size, "kv_blocks": KV_BLOCKS,
                           "extra_args": ["--prefill-timeout", str(self.sizes.prefill_timeout_s)]},
                "gateway": gateway,
                "health_interval_s": self.sizes.health_interval_s, "unhealthy_after": self.sizes.unhealthy_after,
                "internal_token": token}

    def start(self, timeout_s: float = 300.0) -> None:
        token = secrets.token_urlsafe(24)
        self._token_before = os.environ.get(auth.ENV)
        os.environ[auth.ENV] = self.env[auth.ENV] = token  # this process's channels send it (until stop)
        config = self.workdir / "chaos.yaml"
        config.write_text(yaml.safe_dump(self.config(token)))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(BIN / "pdserve"), "serve", "--config", str(config), "--port",
                                          str(self.port), "--num-cpus", "4"], cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "serving " not in self.log_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve serve did not start:\n{self.log_text()[-3000:]}")
            time.sleep(0.5)
        self.address = re.search(r"Ray cluster at (\S+)", self.log_text()).group(1)
        self._feed = StatusFeed(self.address, self.env, self.workdir / "status-feed.log")

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGTERM (the driver stops everything it started); its exit code and any process left."""
        if self.proc is None:
            return None, []
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        tree = self.tree()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        _, alive = psutil.wait_procs(tree, timeout=30)
        left = []
        for p in alive:
            try:
                left.append(" ".join(p.cmdline())[:120])
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for channel in self._channels.values():
            channel.close()
        if self._token_before is None:
            os.environ.pop(auth.ENV, None)
        else:
            os.environ[auth.ENV] = self._token_before
        self.proc = None
        return code, left

    def set_transfer_fault(self, fault: str | None) -> None:
        """Put a transfer fault (`delay_s=1`, `error_rate=0.5`: transfer/faults.py) on every
        prefill worker's pushes, or lift it (None). Written whole, then renamed into place."""
        if fault is None:
            self.transfer_fault_file.unlink(missing_ok=True)
            return
        tmp = self.transfer_fault_file.with_suffix(".tmp")
        tmp.write_text(fault + "\n")
        tmp.replace(self.transfer_fault_file)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def status(self) -> dict:
        """What `pdserve status --json` prints, from one Ray driver kept open for the
        deployment's life (bench/chaos/status_feed.py): a new driver per call costs seconds of CPU."""
        if self._feed is None:
            raise RuntimeError("the deployment is not running")
        return self._feed.status()

    def workers(self) -> list[dict]:
        return [slot for pool in self.status()["pools"].values() for slot in pool]

    def worker(self, role: str, worker_id: str = "0") -> dict:
        return next(w for w in self.workers() if w["role"] == role and w["worker_id"] == worker_id)

    def group(self, worker: dict) -> list[psutil.Process]:
        """A worker's processes: its own (rank 0), then the ranks it spawned (multiprocessing's
        `spawn_main`; its resource tracker aside). One process for a worker of one rank."""
        root = psutil.Process(worker["pid"])
        ranks = []
        for p in root.children():
            try:
                line = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                continue
            if "spawn_main" in line and "resource_tracker" not in line:
                ranks.append(p)
        return [root, *ranks]

    def gateway(self) -> psutil.Process:
        """The `python -m gateway` process (a child of its host actor, in the serve tree)."""
        for p in self.tree():
            try:
                if p.cmdline()[1:3] == ["-m", "gateway"]:
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
                continue
        raise LookupError("no gateway process in the pdserve serve tree")

    def stats(self, worker: dict) -> pb.StatsResponse | None:
        address = worker["address"]
        if address not in self._channels:
            self._channels[address] = auth.channel(address)
        try:
            return pb_grpc.WorkerStub(self._channels[address]).Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def metric_workers(self) -> set[str]:
        """The workers the gateway's /metrics has KV gauges for."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return set()
        return set(re.findall(r'^pdserve_worker_kv_blocks_total\{worker="([^"]+)"\}', text, re.MULTILINE))

    def replays(self) -> float:
        """Streams the gateway has replayed on another decode worker (pdserve_decode_retries_total)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(r'^pdserve_decode_retries_total\{when="mid_stream"\} (\S+)$', text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def rss_mb(self) -> dict[str, float]:
        procs = {f"{w['role']}-{w['worker_id']}": w["pid"] for w in self.workers()}
        procs["gateway"] = self.gateway().pid
        out = {}
        for name, pid in procs.items():
            try:
                out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
            except (psutil.NoSuchProcess, TypeError):
                pass
        return out

    async def logged(self, pattern: str, offset: int, timeout_s: float) -> float | None:
        """When (monotonic) the serve log, past `offset`, first shows `pattern`; None at the timeout."""
        seen = re.compile(pattern)
        ok = await until(lambda: _true(seen.search(self.log_text(), offset)), timeout_s, 0.2)
        return time.monotonic() if ok else None

    async def all_ready(self, timeout_s: float = RECOVERY_TIMEOUT_S) -> list[dict]:
        """Every slot ready (a replaced worker's new incarnation included)."""
        workers: list[dict] = []

        async def ready() -> bool:
            workers[:] = await asyncio.to_thread(self.workers)
            return all(w["state"] == "ready" for w in workers)

        await until(ready, timeout_s, 1.0)
        return workers

    async def idle_leaks(self, workers: list[dict], timeout_s: float = 60.0) -> tuple[int | None, dict[str, str]]:
        """Wait until every worker is idle with all its KV blocks free; then the blocks still
        held, summed (None if a worker did not answer), and each worker's view."""
        stats: list[pb.StatsResponse | None] = []

        async def idle() -> bool:
            stats[:] = await asyncio.gather(*(asyncio.to_thread(self.stats, w) for w in workers))
            return all(s is not None and s.free_blocks == s.total_blocks and not s.running_requests
                       and not s.waiting_requests for s in stats)

        await until(idle, timeout_s, 0.5)
        held = {f"{w['role']}-{w['worker_id']}": "no answer" if s is None else
                f"{s.total_blocks - s.free_blocks} held, {s.running_requests} running, {s.waiting_requests} waiting"
                for w, s in zip(workers, stats)}
        leaked = None if any(s is None for s in stats) else sum(s.total_blocks - s.free_blocks for s in stats)
        return leaked, held


async def _true(value: object) -> bool:
    return bool(value)

