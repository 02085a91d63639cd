"""The systems bench/peer_serving.py compares, each started on the same cores and stopped
with its whole process group: vLLM (one engine on every core, its data parallelism, its
P/D behind bench/peer_proxy.py) and pdserve (aggregated, 1P+1D). `start(setup, name)` is a
context manager yielding the system's URL once it answers /health (vLLM) or /ready (pdserve).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.worker_procs import free_port

START_TIMEOUT_S = 900.0  # vLLM compiles its graphs at start (20-100 s on 2 cores), pdserve converts on first use
STOP_TIMEOUT_S = 60.0

def say(message: str) -> None:
    print(f"[peer-serving {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- processes ------------------------------------------------------------------------------

@dataclass
class Child:
    """A started process (its own session: the whole group is stopped with it) and its log."""

    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def spawn(name: str, cmd: list[str], env: dict[str, str], logs: Path, cwd: Path | None = None) -> Child:
    log = logs / f"{name.replace(' ', '-')}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Child(name, proc, log)


def wait_healthy(children: list[Child], url: str, path: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until GET url+path answers 200; fails with the log tail of a child that exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        for c in children:
            if c.proc.poll() is not None:
                raise SystemExit(f"{c.name} exited with {c.proc.returncode} while starting ({c.log}):\n{c.tail()}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}{path} not healthy after {timeout_s:.0f} s; logs: "
                             + ", ".join(str(c.log) for c in children))
        time.sleep(1.0)


# ---- the systems ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What every system of one comparison shares."""

    model: str  # pdserve's name for it
    folder: Path  # the Hugging Face folder both systems load
    dtype: str  # bfloat16 | float32
    cores: int
    vllm_python: str
    logs: Path
    max_model_len: int = 4096


@contextlib.contextmanager
def pdserve_system(setup: Setup, prefill: int) -> Iterator[str]:
    from bench.compare import deployment, serve_command

    port = free_port()
    cmd = serve_command(setup.model, setup.dtype, prefill, setup.cores - prefill, port, setup.cores)
    with deployment(cmd, port, setup.logs / f"pdserve-{prefill}P.log", START_TIMEOUT_S) as url:
        yield url


def vllm_env(cores: str, threads: int) -> dict[str, str]:
    """vLLM's serving environment: its own thread binding (`cores`: "0-1", or "0|1" one
    list per data-parallel rank), which its multiprocess executor applies (the default for
    serving; the in-process engine binds nothing), KV space in GiB per engine, no AOT
    compile (see bench/peer_vllm.py), nothing from the hub."""
    env = {**os.environ, "VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "UCX_NET_DEVICES": "lo",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # nothing of pdserve's in vLLM's processes
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def vllm_command(setup: Setup, port: int, extra: list[str] = ()) -> list[str]:
    return [setup.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.folder),
            "--served-model-name", setup.model, "--dtype", setup.dtype, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(setup.max_model_len), "--disable-log-stats", "--disable-uvicorn-access-log",
            *extra]


@contextlib.contextmanager
def vllm_system(setup: Setup, layout: str) -> Iterator[str]:
    """`layout`: "1x2" (one engine on every core), "2x1" (vLLM's data parallelism: an engine
    per core behind its one API server) or "1P+1D" (a prefill and a decode engine, one core
    each, NixlConnector, behind bench/peer_proxy.py)."""
    children: list[Child] = []
    try:
        if layout in ("1x2", "2x1"):
            port = free_port()
            if layout == "1x2":
                cmd, env = vllm_command(setup, port), vllm_env(f"0-{setup.cores - 1}", setup.cores)
            else:
                cmd = vllm_command(setup, port, ["--data-parallel-size", str(setup.cores)])
                env = vllm_env("|".join(str(i) for i in range(setup.cores)), 1)
            children.append(spawn(f"vllm-{layout}", cmd, env, setup.logs))
            url = f"http://127.0.0.1:{port}"
            wait_healthy(children, url, "/health")
        else:
            ports = [free_port() for _ in range(2)]
            for core, (role, port) in enumerate(zip(("producer", "consumer"), ports)):
                env = {**vllm_env(str(core), 1), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
                kv = {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}", "kv_buffer_device": "cpu"}
                children.append(spawn(f"vllm-{role}", vllm_command(setup, port, ["--kv-transfer-config",
                                                                                  json.dumps(kv)]), env, setup.logs))
            for port in ports:
                wait_healthy(children, f"http://127.0.0.1:{port}", "/health")
            for core, child in enumerate(children):
                pinned = pin_group(child.proc.pid, core)
                say(f"{child.name}: {pinned} threads pinned to core {core}")
            proxy_port = free_port()
            children.append(spawn("vllm-proxy", [sys.executable, "-m", "bench.peer_proxy", "--port", str(proxy_port),
                                                 "--prefill", f"http://127.0.0.1:{ports[0]}",
                                                 "--decode", f"http://127.0.0.1:{ports[1]}"],
                                  {**os.environ, "PYTHONUNBUFFERED": "1"}, setup.logs, cwd=Path(__file__).parent.parent))
            url = f"http://127.0.0.1:{proxy_port}"
            wait_healthy(children, url, "/health", 60)
        yield url
    finally:
        for c in reversed(children):
            c.stop()


def pin_group(pgid: int, core: int) -> int:
    """Every thread of every process in group `pgid` onto `core`; how many were moved.

    vLLM's NIXL worker on CPU moves its own compute thread to the highest core of its NUMA
    node when the connector starts (the same core in the prefill and the decode engine, on
    one host), overriding VLLM_CPU_OMP_THREADS_BIND; after start-up each P/D engine is put
    back on the core it was given, as its binding asked."""
    moved = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                os.sched_setaffinity(int(task.name), {core})
                moved += 1
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return moved


def start(setup: Setup, system: str):
    if system.startswith("pdserve"):
        return pdserve_system(setup, 0 if system.endswith("aggregated") else 1)
    return vllm_system(setup, system.split()[1])
