"""The output path at GPU step rates: decode worker -> gRPC -> gateway -> SSE -> clients,
without the model's cost, before (`--decode-streams request`: one Generate call per request)
and after (`worker`: every request on one Streams call, one message per engine step), side
by side in one run.

    python -m bench.stream_path [--quick] [--batches 32,256,1024] [--steps-ms 5,20,30]
        [--modes request,worker] [--gateways 1,2] [--stream-s 2.5] [--token-budget 150000]
        [--profile-dir DIR] [--out bench/results/stream_path.json]

The decode worker is the real one with its forward pass replaced by a fixed-time step
(bench/harness/fixed_time_worker.py: every step lasts step_s, no model, a GPU step's
stand-in) over a tiny random model whose ids SmolLM2's tokenizer detokenizes; a real
`python -m gateway` serves it (`--gateways G`: G gateway processes on its port,
`--processes G`, for the worker mode; the figures are then the front's and the children's
together). N streaming clients (/v1/completions, stream, ignore_eos,
max_tokens M, a 4-token prompt) open at once, so the decode batch is N; they share one
process and one asyncio loop over raw sockets (a minimal HTTP/1.1 client that timestamps
each read and counts its SSE `data:` lines), cheap beside the worker and the gateway on a
2-core host. A fresh worker and gateway per step time and mode (so the thread counts start
from the same place); the batches run on them in turn, smallest first.

Per configuration:
- delivered tokens/s over the steady part (from the moment every stream has its first token
  to the moment the first stream has its last) against the ideal, batch / step_s, and the
  worker's own tokens/s from its steps' times (what it produced, whether or not the gateway
  and the clients kept up), with the loop's time between two steps;
- CPU per streamed token of the decode worker and of the gateway (/proc/<pid>/stat, the
  whole run, over every token delivered), and of this client process;
- ITL p50 / p99 (gaps between a stream's consecutive tokens in the steady part, as the
  clients see them) against step_s;
- the most threads the worker (and the gateway) had during the run (/proc/<pid>/status);
- the time until every stream had its first token (the ramp: admissions).
Printed as a table with the after/before ratios, and written as JSON to --out.
`--profile-dir` has the workers write cProfile statistics of their threads (CPU time), to
see where a worker's CPU goes; its figures are then the profiler's, not the path's.

As root on a machine with other interfaces, run it in a loopback-only network namespace:
    unshare -n -- sh -c 'ip link set lo up && python -m bench.stream_path'
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.gateway_procs import gateway
from bench.harness.sse_streams import Stream, open_streams
from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO, WorkerProc, WorkerSpec, start_workers, wait_idle
from bench.host_cpu import host_cpu
from common.model_source import resolve_model
from deploy.planner.slo import percentile

MODES = ("request", "worker")  # before, after
PROMPT = [40, 41, 42, 43]  # ids below the tiny model's vocab of 320
MODEL_LEN = 4096  # the tiny model's context, written into its config: room for long streams
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
WORKER_MODULE = "bench.harness.fixed_time_worker"  # started as the worker's "role": `python -m` it


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the processes ---------------------------------------------------------------------------

def tiny_model(folder: Path) -> Path:
    """The tiny random model (vocab 320) with SmolLM2's tokenizer (its ids below 320
    detokenize) and a context of MODEL_LEN (no step computes it: only the engine's buffers)."""
    model = write_tiny_checkpoint(folder, "llama-gqa")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = MODEL_LEN
    (model / "config.json").write_text(json.dumps(config))
    smollm2 = resolve_model("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, model / name)
    return model


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _group_cpu_s(pids: list[int]) -> float:
    """utime + stime of a group of processes (a gateway's front and its children), in seconds."""
    return sum(_cpu_s(p) for p in pids)


def _group_threads(pids: list[int]) -> int:
    return sum(_threads(p) for p in pids)


def _child_pid(marker: bytes, parent: int | None = None) -> int:
    """The pid of this process's child (or `parent`'s) whose command line holds `marker`."""
    return _children(marker, parent)[0]


def _children(marker: bytes, parent: int | None = None) -> list[int]:
    """The pids of this process's children (or `parent`'s) whose command lines hold `marker`."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and marker in cmdline:
            found.append(int(entry))
    if not found:
        raise RuntimeError(f"no child process of {parent} runs {marker!r}")
    return found


@dataclass
class ServingPath:
    """One serving path under test: its URL and the pids whose CPU is measured."""

    url: str
    worker: WorkerProc
    worker_pid: int
    gateways: int  # gateway processes serving (--processes)
    gateway_pids: list[int]  # the one gateway process, or the front and its children


@contextlib.contextmanager
def serving_path(model: Path, step_s: float, mode: str, max_batch: int, max_tokens: int, logs: Path,
                 step_times: Path, profile: Path | None = None, gateways: int = 1):
    """A fixed-time decode worker with room for `max_batch` streams of `max_tokens`, and a
    gateway over it (`gateways` processes on its port) reading its streams the `mode` way.
    When it stops the worker writes its steps' times to `step_times`, and with `profile`
    its threads' cProfile statistics."""
    blocks_per_stream = math.ceil((len(PROMPT) + max_tokens + 1) / 16)
    args = ["--step-s", str(step_s), "--dtype", "float32", "--no-transfer",
            "--max-num-seqs", str(max_batch), "--max-waiting", str(max_batch),
            "--max-num-batched-tokens", str(max(512, 2 * max_batch)),
            "--kv-blocks", str(max_batch * blocks_per_stream + 64), "--step-times", str(step_times)]
    if profile is not None:
        args += ["--profile", str(profile)]
    [worker] = start_workers([WorkerSpec(WORKER_MODULE, args)], model, logs, timeout_s=120)
    try:
        # Room for every stream, and no shedding on a predicted TTFT (the burst's ramp is not
        # what this measures): --max-ttft an hour.
        room = ["--decode-streams", mode, "--max-connections", str(4 * max_batch + 64), "--max-ttft", "3600"]
        if gateways > 1:
            room += ["--processes", str(gateways)]
        with gateway(model, [worker.address], [], logs / f"gateway-{mode}-{gateways}-{step_s:g}.log", *room) as url:
            assert httpx.get(f"{url}/ready", timeout=60).json() == {"ready": True}  # it has the pool's size
            front = _child_pid(b"-m\0gateway\0")
            yield ServingPath(url, worker, worker.proc.pid, gateways,
                              [front, *(_children(b"-m\0gateway\0", front) if gateways > 1 else [])])
    finally:
        worker.stop()


# -- the clients -----------------------------------------------------------------------------

async def _clients(url: str, n: int, max_tokens: int,
                   groups: tuple[list[int], ...]) -> tuple[list[Stream], float, list[int]]:
    """N streams at once; (the streams, the start time, the most threads each group of
    processes had at once)."""
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    peaks = [_group_threads(g) for g in groups]

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.05)
            for i, g in enumerate(groups):
                peaks[i] = max(peaks[i], _group_threads(g))

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    streams = await open_streams(url, n, "/v1/completions", body)
    sampler.cancel()
    return streams, started, peaks


# -- one configuration -----------------------------------------------------------------------

def _steady(streams: list[Stream]) -> tuple[float, float, int]:
    """(start, end, tokens) of the part where every stream runs: from the last first token
    to the first last token; tokens counted from every stream's reads after start up to end."""
    t0 = max(s.times[0] for s in streams)
    t1 = min(s.times[-1] for s in streams)
    tokens = 0
    for s in streams:
        sums = list(itertools.accumulate(s.counts))
        i, j = bisect.bisect_right(s.times, t0), bisect.bisect_right(s.times, t1)
        tokens += (sums[j - 1] if j else 0) - (sums[i - 1] if i else 0)
    return t0, t1, tokens


def _gaps(streams: list[Stream], t0: float, t1: float) -> list[float]:
    """Gaps between a stream's consecutive tokens whose later token came in (t0, t1]; the
    tokens of one read came together (a gap of 0 after the first)."""
    gaps = []
    for s in streams:
        for i in range(bisect.bisect_right(s.times, t0), bisect.bisect_right(s.times, t1)):
            if i:
                gaps.append(s.times[i] - s.times[i - 1])
                gaps += [0.0] * (s.counts[i] - 1)
    return gaps


def worker_cadence(step_times: Path, row: dict) -> dict:
    """The worker's own cadence while all of a run's streams sampled (the steps that began in
    the run's window with every stream): its tokens/s, the period between its steps, how long
    the stand-in step took (past step_s when the host or the GIL kept it from waking), and
    the loop's own time per step around it (schedule, outputs, commands)."""
    since, until = row.pop("window")
    batch = row["batch"]
    if not step_times.is_file():  # the worker did not stop cleanly
        return {}
    steps = []
    for line in step_times.read_text().splitlines():
        began, ended, sampled = line.split()
        if since <= float(began) <= until and int(sampled) == batch:
            steps.append((float(began), float(ended)))
    if len(steps) < 3:
        return {}
    periods = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
    loop = [b[0] - a[1] for a, b in itertools.pairwise(steps)]
    return {"worker_tok_s": batch * (len(steps) - 1) / (steps[-1][0] - steps[0][0]),
            "worker_step_period_p50_s": percentile(periods, 50),
            "worker_step_p50_s": percentile([e - b for b, e in steps], 50),
            "worker_loop_p50_s": percentile(loop, 50), "worker_full_steps": len(steps)}


def measure(path: ServingPath, mode: str, batch: int, step_s: float, max_tokens: int) -> dict:
    load = os.getloadavg()[0]
    groups = ([path.worker_pid], path.gateway_pids)
    cpu0 = [_group_cpu_s(g) for g in groups]
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    streams, started, peaks = asyncio.run(_clients(path.url, batch, max_tokens, groups))
    ended = time.monotonic()
    cpu = [_group_cpu_s(g) - c for g, c in zip(groups, cpu0)]
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (me1.ru_utime - me0.ru_utime) + (me1.ru_stime - me0.ru_stime)
    failed = [s for s in streams if s.error or s.tokens != max_tokens]
    tokens = sum(s.tokens for s in streams)
    idle = wait_idle(path.worker)
    row = {"mode": mode, "gateways": path.gateways, "batch": batch, "step_s": step_s, "max_tokens": max_tokens, "load_1m": load,
           "streams_ok": batch - len(failed), "failures": [s.error or f"{s.tokens} tokens" for s in failed[:3]],
           "tokens": tokens, "wall_s": ended - started, "ideal_tok_s": batch / step_s,
           "worker_cpu_s": cpu[0], "gateway_cpu_s": cpu[1], "client_cpu_s": client_cpu,
           "worker_cpu_us_per_token": 1e6 * cpu[0] / max(tokens, 1),
           "gateway_cpu_us_per_token": 1e6 * cpu[1] / max(tokens, 1),
           "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1),
           "worker_threads_peak": peaks[0], "gateway_threads_peak": peaks[1],
           "worker_left_idle": idle.running_requests == idle.waiting_requests == 0
                               and idle.free_blocks == idle.total_blocks, "window": (started, ended)}
    ok = [s for s in streams if s.times]
    if failed or not ok:
        return {**row, "delivered_tok_s": None, "of_ideal": None}
    firsts = sorted(s.times[0] - started for s in ok)
    t0, t1, steady_tokens = _steady(ok)
    row.update(all_running_s=firsts[-1], ttft_p50_s=percentile(firsts, 50))
    if t1 <= t0:  # the first stream ended before the last one began: no steady part
        rate = tokens / (ended - started)
        row.update(steady_s=0.0, delivered_tok_s=rate, of_ideal=rate * step_s / batch, steady="none: whole run")
        t0, t1 = started, ended
    else:
        rate = steady_tokens / (t1 - t0)
        row.update(steady_s=t1 - t0, delivered_tok_s=rate, of_ideal=rate * step_s / batch)
    gaps = _gaps(ok, t0, t1)
    row.update(itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99), itl_mean_s=sum(gaps) / max(len(gaps), 1))
    return row


def max_tokens_for(batch: int, step_s: float, stream_s: float, token_budget: int) -> int:
    """Tokens per stream: `stream_s` of steady streaming at the ideal rate, plus a step per 8
    streams for the ramp (a burst of opens reaches the gateway and the worker a few at a
    time), at most `token_budget` in all over the batch (a host that delivers far below the
    ideal would take minutes otherwise), at least 64."""
    wanted = math.ceil(stream_s / step_s) + batch // 8
    return max(64, min(wanted, token_budget // batch, MODEL_LEN - len(PROMPT) - 1))


# -- the run ---------------------------------------------------------------------------------

def _ratio(after, before) -> float | None:
    return after / before if after is not None and before else None


def compare(rows: list[dict]) -> list[dict]:
    """Per (batch, step_s, gateways) with both modes: after/before of the figures that
    matter (`worker` with N gateway processes against `request` with one)."""
    by = {(r["mode"], r["batch"], r["step_s"], r["gateways"]): r for r in rows}
    out = []
    for (mode, batch, step_s, gateways), after in by.items():
        before = by.get(("request", batch, step_s, 1))
        if mode != "worker" or before is None:
            continue
        out.append({"batch": batch, "step_s": step_s, "gateways": gateways,
                    "delivered": _ratio(after["delivered_tok_s"], before["delivered_tok_s"]),
                    "worker_cpu_cut": _ratio(before["worker_cpu_us_per_token"], after["worker_cpu_us_per_token"]),
                    "gateway_cpu_cut": _ratio(before["gateway_cpu_us_per_token"], after["gateway_cpu_us_per_token"]),
                    "worker_threads": _ratio(after["worker_threads_peak"], before["worker_threads_peak"])})
    return out


def _cell(value, fmt: str, width: int) -> str:
    return format(value, fmt).rjust(width) if value is not None else "n/a".rjust(width)


# (heading, width, the cell of a run): the table's columns
_COLUMNS = [
    ("mode", 8, lambda r: r["mode"]),
    ("gw", 2, lambda r: str(r["gateways"])),
    ("batch", 5, lambda r: str(r["batch"])),
    ("step ms", 7, lambda r: f"{r['step_s'] * 1e3:g}"),
    ("M", 4, lambda r: str(r["max_tokens"])),
    ("ok", 5, lambda r: str(r["streams_ok"])),
    ("tok/s", 7, lambda r: _cell(r["delivered_tok_s"], ".0f", 7)),
    ("ideal", 7, lambda r: f"{r['ideal_tok_s']:.0f}"),
    ("x ideal", 7, lambda r: _cell(r["of_ideal"], ".2f", 6) + ("*" if r.get("steady_s") == 0 else " ")),
    ("wkr x", 5, lambda r: _cell(r["worker_tok_s"] / r["ideal_tok_s"] if "worker_tok_s" in r else None, ".2f", 5)),
    ("loop ms", 7, lambda r: _cell(r["worker_loop_p50_s"] * 1e3 if "worker_loop_p50_s" in r else None, ".1f", 7)),
    ("ITL p50", 7, lambda r: _cell(r["itl_p50_s"] * 1e3 if r.get("itl_p50_s") is not None else None, ".1f", 7)),
    ("p99", 6, lambda r: _cell(r["itl_p99_s"] * 1e3 if r.get("itl_p99_s") is not None else None, ".1f", 6)),
    ("ramp s", 6, lambda r: _cell(r.get("all_running_s"), ".2f", 6)),
    ("wkr us/tok", 10, lambda r: f"{r['worker_cpu_us_per_token']:.1f}"),
    ("gw us/tok", 9, lambda r: f"{r['gateway_cpu_us_per_token']:.1f}"),
    ("cli us/tok", 10, lambda r: f"{r['client_cpu_us_per_token']:.1f}"),
    ("wkr thr", 7, lambda r: str(r["worker_threads_peak"])),
    ("load", 5, lambda r: f"{r['load_1m']:.2f}"),
]


def print_table(result: dict) -> None:
    print(f"\nhost CPU: {result['host_cpu']}, {result['cores']} cores; load average at start "
          f"{result['load_at_start']:.2f}, at end {result['load_at_end']:.2f}")
    print(" ".join(h.rjust(w) for h, w, _ in _COLUMNS))
    for r in result["runs"]:
        print(" ".join(cell(r).rjust(w) for _, w, cell in _COLUMNS))
    print("tok/s: delivered to the clients while every stream ran; wkr x: the worker's own steps' tokens/s over "
          "the ideal;\nloop ms: the worker loop's time between two steps (p50); ramp s: until every stream had "
          "its first token;\nus/tok: CPU per token delivered (worker, gateway, clients); wkr thr: the worker's "
          "most threads")
    if any(r.get("steady_s") == 0 for r in result["runs"]):
        print("* no moment with every stream running (the last first token came after the first last one): "
              "the whole run's rate, ramp included")
    if result["after_over_before"]:
        print("\nafter (worker) / before (request):")
        heads = ("delivered", "worker CPU/token cut", "gateway CPU/token cut", "worker threads")
        print(f"{'batch':>5} {'step ms':>7} {'gw':>2} " + " ".join(h.rjust(len(h)) for h in heads))
        for c in result["after_over_before"]:
            cells = [_cell(c[k], ".2f", len(h) - 1) + "x" if c[k] is not None else "n/a".rjust(len(h))
                     for k, h in zip(("delivered", "worker_cpu_cut", "gateway_cpu_cut", "worker_threads"), heads)]
            print(f"{c['batch']:5d} {c['step_s'] * 1e3:7g} {c['gateways']:2d} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="32,256,1024", help="concurrent streams per configuration")
    p.add_argument("--steps-ms", default="5,20,30", help="engine step times, in milliseconds")
    p.add_argument("--modes", default=",".join(MODES), help="gateway --decode-streams modes to run")
    p.add_argument("--gateways", default="1",
                   help="comma-separated gateway process counts for the worker mode (--processes N); "
                        "the request mode (before) runs with one")
    p.add_argument("--stream-s", type=float, default=2.5, help="seconds of steady streaming at the ideal rate")
    p.add_argument("--token-budget", type=int, default=150_000, help="most tokens one configuration streams")
    p.add_argument("--profile-dir", default=None,
                   help="the workers write cProfile statistics of all their threads here (slows them: not for figures)")
    p.add_argument("--quick", action="store_true", help="batch 256 at 20 ms only, short streams")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "stream_path.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.steps_ms, args.stream_s = "256", "20", 1.5
    batches = sorted(int(b) for b in args.batches.split(","))
    steps = [float(s) / 1e3 for s in args.steps_ms.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    gateway_counts = sorted(int(g) for g in args.gateways.split(","))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the clients' sockets, and the gateway's (inherited)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * max(batches) + 1024)), hard))

    work = Path(tempfile.mkdtemp(prefix="pdserve-stream-path-"))
    model = tiny_model(work / "model")
    result = {"host_cpu": host_cpu().name, "cores": os.cpu_count(), "load_at_start": os.getloadavg()[0],
              "prompt_tokens": len(PROMPT), "runs": []}
    _say(f"host {result['host_cpu']}, load {result['load_at_start']:.2f}; logs in {work}")
    for step_s in steps:
        longest = max(max_tokens_for(b, step_s, args.stream_s, args.token_budget) for b in batches)
        for mode, gateways in [(m, g) for m in modes for g in (gateway_counts if m == "worker" else [1])]:
            name = f"{mode}-{gateways}gw-{step_s * 1e3:g}ms"
            profile = Path(args.profile_dir) / f"worker-{name}.prof" if args.profile_dir else None
            step_times, rows = work / f"steps-{name}.txt", []
            with serving_path(model, step_s, mode, max(batches), longest, work, step_times, profile,
                              gateways) as path:
                asyncio.run(_clients(path.url, 4, 8, ([path.worker_pid], path.gateway_pids)))  # a first call each way
                wait_idle(path.worker)
                for batch in batches:
                    m = max_tokens_for(batch, step_s, args.stream_s, args.token_budget)
                    row = measure(path, mode, batch, step_s, m)
                    rows.append(row)
                    rate = row["delivered_tok_s"]
                    _say(f"{mode:>7} x{gateways} batch {batch} step {step_s * 1e3:g} ms: "
                         + (f"{rate:.0f} tok/s = {row['of_ideal']:.2f}x ideal, " if rate is not None else
                            f"{row['streams_ok']}/{batch} ok {row['failures']}, ")
                         + f"worker {row['worker_cpu_us_per_token']:.1f} us/token, "
                         f"gateway {row['gateway_cpu_us_per_token']:.1f} us/token, "
                         f"{row['worker_threads_peak']} worker threads")
            for row in rows:  # the worker has stopped: its step times are written
                row.update(worker_cadence(step_times, row))
            result["runs"] += rows
    result["load_at_end"] = os.getloadavg()[0]
    result["after_over_before"] = compare(result["runs"])
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    _say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
