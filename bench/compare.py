"""Aggregated vs disaggregated on the same cores, in one run: `pdserve bench --compare`.

    pdserve bench --compare --cores 2 [--prefill-workers 1] --dtype bfloat16 --port 8000 \\
        --workload long-prompt --sweep 0.1,0.2,0.4 --num-requests 40 --json cmp.json --plot cmp

Starts `pdserve serve --prefill 0 --decode N` (aggregated: every worker prefills and
decodes) and then `pdserve serve --prefill P --decode N-P` (disaggregated), each on an
embedded Ray offering N CPUs (one core per worker), waits until it serves (its "serving "
line, then /ready), runs the same sweep against it (same lengths, arrivals and seeds),
stops it with SIGTERM, and prints both tables, then goodput side by side and their ratio.
As root on a machine with other interfaces, run it in a loopback-only network namespace:
    unshare -n -- sh -c 'ip link set lo up && pdserve bench --compare --cores 2 ...'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.serving import (Target, config_of, goodput, load_tokenizer, plan_of, result_json, sweep, table,
                           warm_up)

SERVE_TIMEOUT_S = 600.0  # model conversion on first use, Ray start, worker start
STOP_TIMEOUT_S = 120.0


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def serve_command(model: str, dtype: str, prefill: int, decode: int, port: int, cores: int) -> list[str]:
    return [sys.executable, "-m", "deploy", "serve", "--model", model, "--dtype", dtype, "--prefill", str(prefill),
            "--decode", str(decode), "--host", "127.0.0.1", "--port", str(port), "--num-cpus", str(cores)]


@contextlib.contextmanager
def deployment(cmd: list[str], port: int, log_path: Path, timeout_s: float = SERVE_TIMEOUT_S) -> Iterator[str]:
    """`pdserve serve` as a child (its own session) until it serves and /ready; yields its URL.
    Always stopped on exit: SIGTERM, then SIGKILL of its process group after STOP_TIMEOUT_S."""
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}  # embedded Ray, never a cluster around
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "serving " not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve bench: the deployment did not start ({log_path}):\n"
                                 + "\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))
            time.sleep(0.5)
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve bench: {url}/ready never answered 200 ({log_path})")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _say(f"the deployment did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def run_compare(args: argparse.Namespace) -> int:
    n, p = args.cores, args.prefill_workers
    if not 1 <= p < n:
        raise SystemExit(f"pdserve bench: --prefill-workers must be in 1..{n - 1} for --cores {n}")
    plan, tokenizer = plan_of(args), load_tokenizer(args)
    setups = {f"aggregated 0P+{n}D": (0, n), f"disaggregated {p}P+{n - p}D": (p, n - p)}
    logs = Path(tempfile.mkdtemp(prefix="pdserve-compare-"))
    results = {}
    for name, (prefill, decode) in setups.items():
        _say(f"{name}: starting (log {logs / name.split()[0]}.log)")
        cmd = serve_command(args.model, args.dtype, prefill, decode, args.port, n)
        with deployment(cmd, args.port, logs / f"{name.split()[0]}.log") as url:
            target = Target(url, args.model, args.api_key, args.timeout)
            warm_up(target, tokenizer)
            results[name] = sweep(target, plan, args.loads, tokenizer, args.goodput_search)
        _say(f"{name}: stopped")
    if args.json:
        config = {**config_of(args, plan), "url": f"http://127.0.0.1:{args.port}", "cores": n, "dtype": args.dtype}
        deployments = {name: result_json({**config, "prefill": s[0], "decode": s[1]}, results[name])
                       for name, s in setups.items()}
        Path(args.json).write_text(json.dumps({"deployments": deployments, "goodput_ratio": ratio(results)}, indent=1))
    if args.plot:
        from bench.plots import plot_runs

        for path in plot_runs(results, plan.slo, args.plot):
            _say(f"wrote {path}")
    print(f"\n{args.model} {args.dtype}, {n} cores (one per worker), workload {plan.workload}, seed {plan.seed}")
    for name, runs in results.items():
        print(f"\n{name}\n{table(runs, plan.slo)}")
    print(side_by_side(results))
    return 0


def side_by_side(results: dict) -> str:
    """Attainment and p90s per load for each deployment, then goodput and its ratio."""
    names = list(results)
    loads = sorted({r.load.x for runs in results.values() for r in runs})
    key = next(iter(results.values()))[0].load.key
    lines = [f"{'':>11}" + "".join(f" | {n:<30}" for n in names),
             f"{key:>11}" + " | SLO ok  TTFT p90 ms  TPOT p90 ms" * len(names)]
    for x in loads:
        row = f"{x:>11g}"
        for name in names:
            run = next((r for r in results[name] if r.load.x == x), None)
            if run is None:
                row += f" | {'-':>6} {'-':>11} {'-':>11}"
                continue
            s = run.summary
            ttft = "-" if s["ttft_s"]["p90"] is None else f"{s['ttft_s']['p90'] * 1e3:.0f}"
            tpot = "-" if s["tpot_s"]["p90"] is None else f"{s['tpot_s']['p90'] * 1e3:.0f}"
            row += f" | {s['slo_attainment']:>6.0%} {ttft:>11} {tpot:>11}"
        lines.append(row)
    g = {name: goodput(runs) for name, runs in results.items()}
    lines.append("goodput: " + ", ".join(f"{name} {'none' if v is None else f'{v:g} req/s'}" for name, v in g.items()))
    r = ratio(results)
    lines.append("goodput ratio: n/a (a deployment passed no load)" if r is None else
                 f"goodput ratio {names[1]} / {names[0]}: {r:.2f}x")
    return "\n" + "\n".join(lines)


def ratio(results: dict) -> float | None:
    """Goodput of the second deployment over the first's; None unless both have one."""
    a, d = (goodput(runs) for runs in results.values())
    return d / a if a and d else None
