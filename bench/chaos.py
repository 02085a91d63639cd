"""Faults, overload and abuse against the real system: `python -m bench.chaos`.

Starts `pdserve serve` (embedded Ray, SmolLM2 in float32, 1 prefill + 2 decode workers) as
a subprocess and runs the scenarios against it one after another (docs/chaos.md says what
each does): the overload on a deployment of its own whose gateway sheds past a TTFT bound,
the others on one that never sheds. It prints one row per scenario:

- completed: HTTP 200 and a finished answer (a stream: a finish_reason, then [DONE]);
- failed cleanly: an OpenAI-shaped JSON error (429 shed, 503 no worker, ...), or an SSE
  error event followed by [DONE];
- dropped: a transport error, a stream cut before [DONE] or an error body that is not
  JSON; expected only when the gateway process itself is killed;
- hung: no end within the client's timeout (must be 0);
- leaked blocks: once every worker is back and idle, KV blocks not free, summed over the
  workers (Stats over the internal gRPC; must be 0);
- recovery s: from the fault until a fresh request succeeds again.

    python -m bench.chaos [--only storm,kill-decode] [--quick] [--json out.json]

As root, run it in a loopback-only network namespace (embedded Ray binds to the node's address):
    unshare -n -- sh -c 'ip link set lo up && OMP_NUM_THREADS=1 .venv/bin/python -m bench.chaos'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import grpc
import httpx
import psutil
import yaml

from bench.serving import percentile
from engine import envs
from engine.rpc import auth
from engine.rpc import pdserve_pb2 as pb
from engine.rpc import pdserve_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = "smollm2"
KV_BLOCKS = 512  # per worker (16 tokens each): small enough that the overload presses on it
MAX_TTFT_S = 4.0  # the gateway's admission bound (gateway.max_ttft_s)
MAX_OUTPUT_TOKENS = 256  # the gateway's cap on max_tokens: keeps fuzzed requests short
TOKENS = range(1000, 40000)  # prompt token ids: plain vocabulary, no special tokens
CLIENT_TIMEOUT_S = 120.0  # a request with no end by then is hung
RECOVERY_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is: the full run, and --quick (tests/test_chaos.py)."""

    storm: int  # requests in the cancellation storm, 30% of them left by their client
    storm_concurrency: int
    storm_prompt: int  # storm prompts: 8 to this many tokens
    storm_output: int  # storm outputs: 2 to this many tokens
    streams: int  # requests in flight when a process is killed
    stream_tokens: int  # their output tokens
    long_prompt: int  # tokens per prompt in transfer when the prefill worker dies
    probe_s: float  # the closed-loop capacity probe before the overload
    overload_s: float  # open loop at 5x that capacity
    fuzz_examples: int  # per schemathesis mode, and for the hypothesis bodies and headers
    half_reads: int  # raw connections that stop reading (or sending) halfway
    abuse_rounds: int  # the gateway's RSS is read after each: growth past the first round is a leak
    health_interval_s: float  # the controller's rounds
    unhealthy_after: int  # failed deep checks before a wedged worker is replaced


FULL = Sizes(1000, 48, 128, 16, 16, 128, 800, 10.0, 20.0, 100, 48, 2, 2.0, 3)
QUICK = Sizes(150, 32, 128, 16, 8, 64, 400, 5.0, 6.0, 25, 12, 1, 1.0, 2)


# ---- how a request ended ---------------------------------------------------------------

class Outcome(str, Enum):
    COMPLETED = "completed"
    FAILED_CLEANLY = "failed cleanly"
    DROPPED = "dropped"
    HUNG = "hung"
    CANCELLED = "cancelled"  # the client left on purpose


@dataclass
class Record:
    outcome: Outcome = Outcome.DROPPED
    status: int | None = None  # HTTP status, once the answer began
    code: str | None = None  # an error's "code" (a 429's: overloaded, or a tenant limit)
    answered_s: float | None = None  # sent -> response headers
    ttft_s: float | None = None  # sent -> first text
    chunks: int = 0  # SSE chunks that carried text
    error: str = ""


@dataclass
class Result:
    scenario: str
    completed: int = 0
    failed_cleanly: int = 0
    dropped: int = 0
    hung: int = 0
    cancelled: int = 0
    http_5xx: int = 0
    leaked_blocks: int | None = None  # None: a worker did not answer Stats
    recovery_s: float | None = None  # fault scenarios only
    replaced_s: float | None = None  # fault -> the new incarnation (or gateway) ready
    dropped_ok: bool = False  # the gateway itself was killed: its clients see cut connections
    fault: bool = False
    no_5xx: bool = False  # the scenario sends nothing a healthy server may answer with a 5xx
    broken: list[str] = field(default_factory=list)  # what else the scenario found wrong
    figures: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def count(self, records: list[Record]) -> Result:
        for r in records:
            name = r.outcome.name.lower()
            setattr(self, name, getattr(self, name) + 1)
            self.http_5xx += r.status is not None and r.status >= 500
        return self

    def problems(self) -> list[str]:
        """What the issue's figures forbid: hangs, leaks, 5xx under abuse, lost recovery."""
        out = ([f"{self.hung} hung"] if self.hung else []) + self.broken
        if self.leaked_blocks != 0:
            out.append(f"leaked blocks: {self.leaked_blocks} ({self.figures.get('held')})")
        if self.dropped and not self.dropped_ok:
            out.append(f"{self.dropped} dropped (cut streams or non-JSON errors)")
        if self.no_5xx and self.http_5xx:
            out.append(f"{self.http_5xx} responses with a 5xx status")
        if self.fault and self.recovery_s is None:
            out.append("no fresh request succeeded after the fault")
        return out


# ---- the client --------------------------------------------------------------------------

def completion(prompt_len: int, max_tokens: int, rng: random.Random, stream: bool = True) -> dict:
    """Exactly max_tokens tokens on a fresh random prompt (no prefix-cache hits)."""
    return {"model": MODEL, "prompt": [rng.choice(TOKENS) for _ in range(prompt_len)], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))


async def send(http: httpx.AsyncClient, url: str, body: dict, *, leave_after_s: float | None = None,
               leave_after_chunks: int | None = None, on_text: Callable[[], None] | None = None,
               timeout_s: float = CLIENT_TIMEOUT_S) -> Record:
    """POST /v1/completions and say how it ended. The client leaves on purpose (closing the
    connection) after `leave_after_s` seconds or after `leave_after_chunks` text chunks."""
    rec = Record()
    exchange = _exchange(http, url, body, rec, leave_after_chunks, on_text)
    try:
        if leave_after_s is None:
            await asyncio.wait_for(exchange, timeout_s)
        else:
            try:
                await asyncio.wait_for(exchange, leave_after_s)
            except TimeoutError:
                rec.outcome = Outcome.CANCELLED
    except TimeoutError:
        rec.outcome, rec.error = Outcome.HUNG, f"no end within {timeout_s:.0f}s"
    return rec


async def _exchange(http: httpx.AsyncClient, url: str, body: dict, rec: Record, leave_after_chunks: int | None,
                    on_text: Callable[[], None] | None) -> None:
    t0 = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec.status, rec.answered_s = resp.status_code, time.monotonic() - t0
            if resp.status_code != 200 or not body.get("stream"):
                _classify_body(rec, await resp.aread())
                return
            errored = finished = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    rec.outcome = (Outcome.FAILED_CLEANLY if errored else
                                   Outcome.COMPLETED if finished else Outcome.DROPPED)
                    rec.error = rec.error or ("" if finished else "[DONE] without a finish_reason")
                    return
                if errored:
                    rec.error += "; an event after the error event"
                    return
                event = json.loads(data)
                if "error" in event:
                    errored, rec.error = True, str(event["error"].get("message"))
                    continue
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        rec.chunks += 1
                        if rec.ttft_s is None:
                            rec.ttft_s = time.monotonic() - t0
                            if on_text is not None:
                                on_text()
                    finished |= choice.get("finish_reason") is not None
                if leave_after_chunks is not None and rec.chunks >= leave_after_chunks and not finished:
                    rec.outcome = Outcome.CANCELLED  # leaving the block closes the connection
                    return
            rec.error = "the stream ended before [DONE]"
    except (httpx.HTTPError, ValueError) as e:  # transport, or an event that is not JSON
        rec.outcome, rec.error = Outcome.DROPPED, f"{type(e).__name__}: {e}"


def _classify_body(rec: Record, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if rec.status == 200:
        rec.outcome = Outcome.COMPLETED if isinstance(data, dict) and data.get("choices") else Outcome.DROPPED
    elif isinstance(error, dict) and "message" in error:
        rec.outcome, rec.code, rec.error = Outcome.FAILED_CLEANLY, error.get("code"), str(error["message"])
    else:
        rec.outcome, rec.error = Outcome.DROPPED, f"HTTP {rec.status} without a JSON error: {raw[:200]!r}"


async def recover(http: httpx.AsyncClient, url: str, since: float, rng: random.Random,
                  timeout_s: float = RECOVERY_TIMEOUT_S, prompt_len: int = 8) -> tuple[float | None, list[Record]]:
    """Fresh small requests, one after another, until one completes: seconds since `since`."""
    probes: list[Record] = []
    while time.monotonic() < since + timeout_s:
        rec = await send(http, url, completion(prompt_len, 2, rng, stream=False), timeout_s=60.0)
        probes.append(rec)
        if rec.outcome is Outcome.COMPLETED:
            return time.monotonic() - since, probes
        await asyncio.sleep(0.25)
    return None, probes


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


# ---- the deployment ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """`pdserve serve` with the chaos config, as a subprocess in a session of its own.

    `max_ttft_s` is the gateway's admission bound (None: never shed). The config names the
    internal gRPC token (and this process's environment carries it), so Stats can be read
    from every worker; PDSERVE_FAULT_STALL_FILE is set for the whole deployment (every worker
    inherits it) and names no worker until the wedge scenario writes one's name into it."""

    def __init__(self, workdir: Path, sizes: Sizes, max_ttft_s: float | None = None):
        self.workdir, self.sizes, self.max_ttft_s = workdir, sizes, max_ttft_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "serve.log"
        self.stall_file = workdir / "stall"
        self.address = ""
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", envs.FAULT_STALL_FILE: str(self.stall_file)}
        self._channels: dict[str, grpc.Channel] = {}
        self._token_before: str | None = None

    def config(self, token: str) -> dict:
        return {"dtype": "float32", "prefill": {"replicas": 1, "kv_blocks": KV_BLOCKS},
                "decode": {"replicas": 2, "kv_blocks": KV_BLOCKS},
                "gateway": {"max_ttft_s": self.max_ttft_s, "max_output_tokens": MAX_OUTPUT_TOKENS},
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

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGTERM (the driver stops everything it started); its exit code and any process left."""
        if self.proc is None:
            return None, []
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

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def status(self) -> dict:
        out = subprocess.run([str(BIN / "pdserve"), "status", "--json", "--address", self.address], cwd=REPO,
                             env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"pdserve status failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def workers(self) -> list[dict]:
        return [slot for pool in self.status()["pools"].values() for slot in pool]

    def worker(self, role: str, worker_id: str = "0") -> dict:
        return next(w for w in self.workers() if w["role"] == role and w["worker_id"] == worker_id)

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
        cls = pb_grpc.PrefillWorkerStub if worker["role"] == "prefill" else pb_grpc.DecodeWorkerStub
        try:
            return cls(self._channels[address]).Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def metric_workers(self) -> set[str]:
        """The workers the gateway's /metrics has KV gauges for."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return set()
        return set(re.findall(r'^pdserve_worker_kv_blocks_total\{worker="([^"]+)"\}', text, re.MULTILINE))

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


@dataclass
class Chaos:
    """What every scenario gets: the deployment, the sizes and a seeded random source."""

    dep: Deployment
    sizes: Sizes
    rng: random.Random


async def settle(ctx: Chaos, res: Result, records: list[Record], fault_at: float = 0.0,
                 recovery: asyncio.Task | None = None, replacing: asyncio.Task | None = None) -> Result:
    """After a scenario: its records counted, recovery and replacement times, then every
    worker back, idle and checked for leaked KV blocks."""
    res.count(records)
    res.figures["errors"] = dict(Counter(f"{r.status} {r.error[:90]}" for r in records if r.error).most_common(6))
    if recovery is not None:
        res.recovery_s, probes = await recovery
        res.hung += sum(p.outcome is Outcome.HUNG for p in probes)
        res.figures["recovery_probes"] = dict(Counter(p.outcome.value for p in probes))
    if replacing is not None:
        seen = await replacing
        res.replaced_s = None if seen is None else seen - fault_at
        res.notes.append("not replaced" if seen is None else f"replaced after {res.replaced_s:.1f}s")
    workers = await ctx.dep.all_ready()
    res.leaked_blocks, res.figures["held"] = await ctx.dep.idle_leaks(workers)
    series = await asyncio.to_thread(ctx.dep.metric_workers)
    res.figures["metrics_worker_series"] = len(series)
    if len(series) > len(workers):
        res.notes.append(f"/metrics keeps {len(series) - len(workers)} series of gone workers")
    return res


# ---- fault scenarios -------------------------------------------------------------------------

async def kill_prefill(ctx: Chaos) -> Result:
    """kill -9 of the prefill worker while long prompts' KV is being pushed to the decode
    workers: they must prefill elsewhere (locally) or fail cleanly."""
    res, dep, n = Result("kill-prefill", fault=True), ctx.dep, ctx.sizes.streams
    victim = await asyncio.to_thread(dep.worker, "prefill")
    before = await asyncio.to_thread(dep.stats, victim)
    offset = len(dep.log_text())

    async def pushing() -> bool:  # busy, and some KV already moved: transfers are in flight
        s = await asyncio.to_thread(dep.stats, victim)
        return s is not None and s.kv_blocks_transferred > before.kv_blocks_transferred and \
            (s.running_requests + s.waiting_requests) > 0

    async with client() as http:
        tasks = [asyncio.create_task(send(http, dep.url, completion(ctx.sizes.long_prompt, 8, ctx.rng)))
                 for _ in range(n)]

        async def pushing_or_over() -> bool:
            return all(t.done() for t in tasks) or await pushing()

        if not await until(pushing_or_over, 60) or all(t.done() for t in tasks):
            res.notes.append("no transfer seen before the kill")
        fault_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        replacing = asyncio.create_task(dep.logged(r"prefill worker 0: incarnation \d+ ready", offset,
                                                   RECOVERY_TIMEOUT_S))
        records = await asyncio.gather(*tasks)
        return await settle(ctx, res, records, fault_at, recovery, replacing)


async def _streams_then_kill(ctx: Chaos, res: Result, kill: Callable[[], None], replaced: str) -> Result:
    """Long streams on both decode workers; once every one has its first token, `kill()`."""
    dep, n = ctx.dep, ctx.sizes.streams
    streaming, every = [0], asyncio.Event()

    def on_text() -> None:
        streaming[0] += 1
        if streaming[0] >= n:
            every.set()

    async def stream() -> Record:
        rec = await send(http, dep.url, completion(32, ctx.sizes.stream_tokens, ctx.rng), on_text=on_text)
        if rec.ttft_s is None:  # ended without text (refused): no need to wait for it
            on_text()
        return rec

    offset = len(dep.log_text())
    async with client() as http:
        tasks = [asyncio.create_task(stream()) for _ in range(n)]
        await every.wait()
        if any(t.done() for t in tasks):
            res.notes.append(f"{sum(t.done() for t in tasks)} streams ended before the kill")
        fault_at = time.monotonic()
        kill()
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        replacing = asyncio.create_task(dep.logged(replaced, offset, RECOVERY_TIMEOUT_S))
        records = await asyncio.gather(*tasks)
        return await settle(ctx, res, records, fault_at, recovery, replacing)


async def kill_decode(ctx: Chaos) -> Result:
    """kill -9 of a decode worker mid-stream: its streams end with an error event then
    [DONE]; the others finish; new requests go to the other decode worker."""
    victim = await asyncio.to_thread(ctx.dep.worker, "decode", "0")
    res = Result("kill-decode", fault=True)
    return await _streams_then_kill(ctx, res, lambda: os.kill(victim["pid"], signal.SIGKILL),
                                    r"decode worker 0: incarnation \d+ ready")


async def kill_gateway(ctx: Chaos) -> Result:
    """kill -9 of the gateway process: its clients see cut connections (never a hang), the
    workers cancel the orphaned streams, the controller has Ray restart the gateway."""
    gateway = await asyncio.to_thread(ctx.dep.gateway)
    res = Result("kill-gateway", fault=True, dropped_ok=True)
    return await _streams_then_kill(ctx, res, gateway.kill, "gateway restarted")


async def wedged_decode(ctx: Chaos) -> Result:
    """A decode worker's engine loop stalls while its gRPC server answers: the gateway's
    deep health routes around it, the controller's replaces it; a steady load runs through."""
    res, dep = Result("wedged-decode", fault=True), ctx.dep
    victim = await asyncio.to_thread(dep.worker, "decode", "1")
    name = (await asyncio.to_thread(dep.stats, victim)).worker
    stop, records = asyncio.Event(), []
    offset = len(dep.log_text())

    async with client() as http:
        async def load() -> None:  # closed loop: the next request when the last one ends
            while not stop.is_set():
                records.append(await send(http, dep.url, completion(32, 16, ctx.rng)))

        loaders = [asyncio.create_task(load()) for _ in range(4)]
        await asyncio.sleep(2.0)
        fault_at = time.monotonic()
        tmp = dep.stall_file.with_suffix(".tmp")  # written whole, then renamed: an empty file wedges every worker
        tmp.write_text(name + "\n")
        tmp.replace(dep.stall_file)
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        detecting = asyncio.create_task(dep.logged(r"decode worker 1: failed deep health", offset, 60.0))
        replaced = await dep.logged(r"decode worker 1: incarnation \d+ ready", offset, RECOVERY_TIMEOUT_S)
        detected = detecting.result() if detecting.done() else None
        detecting.cancel()
        await asyncio.sleep(2.0)  # the load goes on over the new membership
        stop.set()
        await asyncio.gather(*loaders)
        dep.stall_file.unlink(missing_ok=True)
        lost = sum(r.outcome is not Outcome.COMPLETED for r in records)
        if detected is not None:
            res.notes.append(f"failed deep health after {detected - fault_at:.1f}s")
        res.replaced_s = None if replaced is None else replaced - fault_at
        res.notes.append("not replaced" if replaced is None else f"replaced after {res.replaced_s:.1f}s")
        res.notes.append(f"lost {lost} of {len(records)}")
        return await settle(ctx, res, records, fault_at, recovery)


# ---- load scenarios ----------------------------------------------------------------------------

LEAVE_KINDS = ("after send", "after first token", "mid-stream", "non-stream after send")


async def storm(ctx: Chaos) -> Result:
    """A cancellation storm: 30% of the requests are left by their client at a random point
    (queued, in prefill, in transfer, mid-decode); nothing may leak or hang."""
    res, dep, s, rng = Result("cancel-storm", no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    gate = asyncio.Semaphore(s.storm_concurrency)
    left: Counter[str] = Counter()

    async def one(http: httpx.AsyncClient, body: dict, kind: str | None, delay: float) -> Record:
        async with gate:
            if kind == "after send":
                return await send(http, dep.url, body, leave_after_s=delay)
            if kind == "non-stream after send":
                return await send(http, dep.url, {**body, "stream": False}, leave_after_s=delay)
            if kind == "after first token":
                return await send(http, dep.url, body, leave_after_chunks=1)
            if kind == "mid-stream":
                chunks = rng.randint(2, max(2, body["max_tokens"] // 2))
                return await send(http, dep.url, body, leave_after_chunks=chunks)
            return await send(http, dep.url, body)

    plans = []
    for _ in range(s.storm):
        kind = rng.choice(LEAVE_KINDS) if rng.random() < 0.3 else None
        left[kind or "stayed"] += 1
        body = completion(rng.randint(8, s.storm_prompt), rng.randint(2, s.storm_output), rng)
        plans.append((body, kind, rng.uniform(0.0, 1.5)))
    t0 = time.monotonic()
    async with client() as http:
        records = await asyncio.gather(*(one(http, *plan) for plan in plans))
    res.figures.update(leave_plan=dict(left), seconds=round(time.monotonic() - t0, 1))
    rejected = sum(r.status == 429 for r in records)
    res.notes.append(f"{len(records)} requests in {res.figures['seconds']}s, "
                     f"{sum(r.outcome is Outcome.CANCELLED for r in records)} left by the client"
                     + (f", {rejected} shed (429)" if rejected else ""))
    return await settle(ctx, res, records)


async def overload(ctx: Chaos) -> Result:
    """Open loop at 5x the capacity a closed-loop probe measured: the admitted requests keep
    the TTFT bound, the rest get a fast 429, memory stays bounded, no worker crashes."""
    res, dep, s, rng = Result("overload-5x", fault=True, no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    rss_before = await asyncio.to_thread(dep.rss_mb)
    async with client() as http:
        t0, probe = time.monotonic(), []

        async def closed_loop() -> None:
            while time.monotonic() - t0 < s.probe_s:
                probe.append(await send(http, dep.url, completion(64, 16, rng)))

        await asyncio.gather(*(closed_loop() for _ in range(8)))
        capacity = sum(r.outcome is Outcome.COMPLETED for r in probe) / (time.monotonic() - t0)
        probe_shed = sum(r.status == 429 for r in probe)
        rate = 5 * max(capacity, 0.2)
        arrivals, at = [], 0.0
        while at < s.overload_s:
            at += rng.expovariate(rate)
            arrivals.append(at)
        start = time.monotonic()

        async def scheduled(at: float) -> Record:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return await send(http, dep.url, completion(64, 16, rng))

        records = await asyncio.gather(*(scheduled(a) for a in arrivals))
        # Once the load is gone, the overload's own request shape is admitted again at once,
        # and so is a long prompt: an idle system has no reason to shed.
        res.recovery_s, _ = await recover(http, dep.url, time.monotonic(), rng, 30.0, prompt_len=64)
        idle = await send(http, dep.url, completion(s.long_prompt, 2, rng, stream=False))
        if idle.outcome is not Outcome.COMPLETED:
            res.broken.append(f"once idle, a {s.long_prompt}-token prompt got {idle.status}: {idle.error}")
    admitted = [r.ttft_s for r in records if r.status == 200 and r.ttft_s is not None]
    shed = [r for r in records if r.status == 429]
    ttft_p90, shed_p99 = percentile(admitted, 90), percentile([r.answered_s for r in shed], 99)
    res = await settle(ctx, res, records)
    rss_after = await asyncio.to_thread(dep.rss_mb)
    res.figures.update(capacity_rps=round(capacity, 2), probe_429=probe_shed, offered_rps=round(rate, 2),
                       ttft_p90_s=ttft_p90,
                       ttft_bound_s=MAX_TTFT_S, rejected=len(shed), time_to_429_p99_s=shed_p99,
                       rejected_by=dict(Counter(r.code for r in shed)), rss_mb_before=rss_before,
                       rss_mb_after=rss_after)
    res.notes.append(f"capacity {capacity:.1f} req/s ({probe_shed} x 429 while probing), offered {rate:.1f}; "
                     "admitted TTFT p90 "
                     f"{_s(ttft_p90)} (bound {MAX_TTFT_S:.0f}s); {len(shed)} x 429, p99 {_s(shed_p99)}; "
                     f"RSS MB {_rss_change(rss_before, rss_after)}")
    return res


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def _rss_change(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {before[k]:.0f}->{after[k]:.0f}" for k in before if k in after)


# ---- abuse ----------------------------------------------------------------------------------------

def _limit_probes() -> list[tuple[str, bytes]]:
    """Bodies past every documented limit, and inputs that have broken JSON servers before."""
    def js(obj: dict) -> bytes:
        return json.dumps(obj).encode()
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [
        ("2 MiB body", js({**base, "prompt": "a " * (1 << 20)})),
        ("prompt past the context", js({**base, "prompt": [1000] * 9000})),
        ("prompt ids out of range", js({**base, "prompt": [-1, 10**12]})),
        ("max_tokens 10**12", js({**base, "max_tokens": 10**12})),
        ("max_tokens 0", js({**base, "max_tokens": 0})),
        ("10k stop strings", js({**base, "stop": ["x"] * 10_000})),
        ("10k logit_bias entries", js({**base, "logit_bias": {str(i): 1 for i in range(10_000)}})),
        ("logit_bias key 10**30", js({**base, "logit_bias": {str(10**30): 1}})),
        ("seed 10**400", b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "seed": 1' + b"0" * 400 + b"}"),
        ("NaN temperature", b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}'),
        ("lone surrogate in the prompt", b'{"model": "smollm2", "prompt": "\\ud800 hi", "max_tokens": 2}'),
        ("lone surrogate in a stop string",
         b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 4, "stop": ["\\udfff"]}'),
        ("lone surrogate in the model", b'{"model": "\\ud800", "prompt": "Hi", "max_tokens": 2}'),
        ("JSON nested 100k deep", b'{"model": "smollm2", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("not JSON", b"{'model': smollm2"),
        ("empty body", b""),
        ("a JSON array", b"[1, 2, 3]"),
        ("chat: 10k messages", js({**chat, "messages": [{"role": "user", "content": "hi"}] * 10_000})),
        ("chat: lone surrogate",
         b'{"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("chat: image part", js({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
    ]


def fuzz(url: str, examples: int, seed: int) -> tuple[Counter, list[str]]:
    """schemathesis (valid and invalid bodies from the gateway's OpenAPI), hypothesis bodies
    and headers, and the limit probes: the status counts, and what answered 5xx (or broke)."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    statuses: Counter = Counter()
    bad: list[str] = []
    run = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    def seen(what: str, status: int | None, text: str = "") -> None:
        statuses[status or "no answer"] += 1
        if status is None or status >= 500:
            bad.append(f"{what[:200]} -> {status}: {text[:200]}")

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @run
        @hypothesis_seed(seed)
        @given(case=schema.as_strategy(mode), served=st.booleans())
        def openapi(case, served):
            if served and mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = MODEL  # else nearly every valid body is a 404 for its random model
                for key in ("max_tokens", "max_completion_tokens"):  # short, so the run stays bounded
                    case.body[key] = min(case.body.get(key) or 4, 4)
            try:
                r = case.call(base_url=url, timeout=CLIENT_TIMEOUT_S)
                seen(f"{case.method} {case.path} {case.body!r}", r.status_code, r.text)
            except Exception as e:  # a transport error: the server dropped the request
                seen(f"{case.method} {case.path} {case.body!r}", None, repr(e))

        openapi()

    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                              lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                        max_size=4), max_leaves=12)
    fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "stream", "stop", "logit_bias", "n",
                              "temperature", "top_p", "top_k", "seed", "logprobs", "echo", "stream_options",
                              "ignore_eos", "max_completion_tokens", "top_logprobs", "user"])
    header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,24}", fullmatch=True).filter(
        lambda h: h.lower() not in ("host", "content-length", "transfer-encoding", "connection", "expect"))
    header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip)
    base = {"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    @run
    @hypothesis_seed(seed)
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           body=st.one_of(st.binary(max_size=300), st.dictionaries(fields, json_value, max_size=4).map(
               lambda d: json.dumps({**base, **d}).encode())),
           content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded",
                                         "multipart/form-data; boundary=x", "application/json; charset=latin-1"]),
           headers=st.dictionaries(header_names, header_values, max_size=4),
           stream=st.booleans())
    def raw(path, body, content_type, headers, stream):
        if stream and body.startswith(b"{"):
            body = body[:-1] + b', "stream": true}'
        try:
            r = httpx.post(f"{url}{path}", content=body, headers={**headers, "Content-Type": content_type},
                           timeout=CLIENT_TIMEOUT_S)
            seen(f"POST {path} {body[:200]!r} {headers}", r.status_code, r.text)
        except httpx.HTTPError as e:
            seen(f"POST {path} {body[:200]!r} {headers}", None, repr(e))

    raw()
    for what, body in _limit_probes():
        for path in ("/v1/completions", "/v1/chat/completions"):
            try:
                r = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"},
                               timeout=CLIENT_TIMEOUT_S)
                seen(f"{what} on {path}", r.status_code, r.text)
            except httpx.HTTPError as e:
                seen(f"{what} on {path}", None, repr(e))
    return statuses, bad


async def half_read(url: str, rng: random.Random) -> None:
    """A raw connection that stops halfway: through sending its body, or through reading the
    SSE stream, then closes."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(completion(rng.randint(8, 64), 64, rng)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if rng.random() < 0.2:  # the body stops partway: the server waits for the rest, then sees the close
            writer.write(head + body[:rng.randint(0, len(body) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            return
        writer.write(head + body)
        await writer.drain()
        want, got = rng.randint(1, 1500), 0
        while got < want:
            chunk = await asyncio.wait_for(reader.read(want - got), CLIENT_TIMEOUT_S)
            if not chunk:
                return
            got += len(chunk)
    finally:
        writer.close()


async def abuse(ctx: Chaos) -> Result:
    """Fuzzed requests, limit probes, SSE reads that stop halfway and a burst past the
    tenant's concurrent-stream limit: no 5xx, the gateway alive, its memory flat."""
    res, dep, s, rng = Result("abuse", no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    gateway = await asyncio.to_thread(dep.gateway)
    rss = [gateway.memory_info().rss / 2**20]
    statuses, bad, burst = Counter(), [], []
    for _ in range(s.abuse_rounds):
        round_statuses, round_bad = await asyncio.to_thread(fuzz, dep.url, s.fuzz_examples, rng.randrange(2**32))
        statuses.update(round_statuses)
        bad += round_bad
        await asyncio.gather(*(half_read(dep.url, rng) for _ in range(s.half_reads)))
        async with client() as http:  # more streams at once than the open tenant's limit (64)
            burst += await asyncio.gather(*(send(http, dep.url, completion(16, 8, rng)) for _ in range(96)))
        try:
            rss.append(gateway.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
    res.completed += sum(n for code, n in statuses.items() if isinstance(code, int) and code < 300)
    res.failed_cleanly += sum(n for code, n in statuses.items() if isinstance(code, int) and 400 <= code < 500)
    res.http_5xx += sum(n for code, n in statuses.items() if isinstance(code, int) and code >= 500)
    res.dropped += statuses.get("no answer", 0)
    alive = await asyncio.to_thread(lambda: httpx.get(f"{dep.url}/health", timeout=10).status_code == 200)
    res = await settle(ctx, res, burst)
    same = (await asyncio.to_thread(dep.gateway)).pid == gateway.pid
    burst_429 = sum(r.status == 429 for r in burst)
    res.figures.update(statuses={str(k): v for k, v in sorted(statuses.items(), key=str)}, bad=bad[:20],
                       burst_429=burst_429, gateway_alive=alive and same, gateway_rss_mb=rss)
    res.notes.append(f"{sum(statuses.values())} fuzzed, {len(bad)} x 5xx/no answer; {len(burst)} streams in "
                     f"bursts of 96: {burst_429} x 429; gateway {'alive' if alive and same else 'RESTARTED'}, "
                     f"RSS MB {'->'.join(f'{x:.0f}' for x in rss)}")
    if not (alive and same):
        res.http_5xx += 1  # counted as a failure: the gateway went down under abuse
    return res


# ---- the run -------------------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Chaos], Awaitable[Result]]] = {
    "overload": overload,  # on a deployment of its own, with the TTFT bound
    "storm": storm, "abuse": abuse, "wedged": wedged_decode,  # the rest share one with no bound; killers last
    "kill-prefill": kill_prefill, "kill-decode": kill_decode, "kill-gateway": kill_gateway,
}


def table(results: list[Result]) -> str:
    head = ("scenario", "completed", "failed cleanly", "dropped", "hung", "leaked blocks", "recovery s", "notes")
    rows = [head] + [(r.scenario, str(r.completed), str(r.failed_cleanly), str(r.dropped), str(r.hung),
                      "?" if r.leaked_blocks is None else str(r.leaked_blocks),
                      "-" if r.recovery_s is None else f"{r.recovery_s:.1f}",
                      "; ".join(r.notes + [f"PROBLEM: {p}" for p in r.problems()])) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def _say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help=f"comma-separated scenarios, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--quick", action="store_true", help="the small sizes tests/test_chaos.py uses")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    names = [n for n in SCENARIOS if n in names]  # the killers always last
    sizes = QUICK if args.quick else FULL
    results, trouble = [], []
    # Shedding is the overload's subject only: the other scenarios test faults, so their
    # deployment never sheds (a 429 would hide what a fault did to a request).
    for group, bound in (([n for n in names if n == "overload"], MAX_TTFT_S),
                         ([n for n in names if n != "overload"], None)):
        if not group:
            continue
        dep = Deployment(Path(tempfile.mkdtemp(prefix="pdserve-chaos-")), sizes, bound)
        _say(f"starting pdserve serve, TTFT bound {bound} (log: {dep.log})")
        dep.start()
        ctx = Chaos(dep, sizes, random.Random(args.seed))
        try:
            for name in group:
                _say(f"{name}: {SCENARIOS[name].__doc__.split(':')[0].strip()}")
                results.append(asyncio.run(SCENARIOS[name](ctx)))
                _say(f"{name}: done, {results[-1].problems() or 'no problem'}")
        finally:
            _say("stopping pdserve serve")
            code, left = dep.stop()
            if code != 0 or left:
                trouble.append(f"pdserve serve exited with {code}; left running: {left}")
    print(table(results))
    print("\n".join(trouble))
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": asdict(sizes), "results": [asdict(r) for r in results]},
                                              indent=1, default=str))
    return 0 if not trouble and not any(r.problems() for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
