"""`pdserve bench` (and `python -m bench.serving_cli`): the serving benchmark's command line.
It parses the options, then runs one sweep against a server (bench/serving.py) or, with
--compare, against an aggregated and a disaggregated deployment in turn (bench/compare.py).
`pdserve` starts it as a program of its own: the benchmark sits above what it measures."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from bench import compare, serving
from deploy.planner.workload import WORKLOADS


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parser(prog: str = "pdserve bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=serving.__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    ap.add_argument("--model", default="smollm2", help="the served model name (and the tokenizer's, see --tokenizer)")
    ap.add_argument("--tokenizer", help="a Hugging Face folder with the served model's tokenizer")
    ap.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    ap.add_argument("--input-len", type=int, help="prompt tokens (--workload fixed; default 256)")
    ap.add_argument("--output-len", type=int, help="output tokens (--workload fixed; default 128)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, nargs="+", help="open-loop Poisson rates, req/s")
    load.add_argument("--sweep", help="comma-separated rates, req/s (the same as --rate R1 R2 ...)")
    load.add_argument("--concurrency", type=int, nargs="+", help="closed-loop streams")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, help="requests per run (default 100)")
    size.add_argument("--duration", type=float, help="seconds of arrivals per run, instead of a request count")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds (default 1.0)")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token (default 0.2)")
    ap.add_argument("--goodput-search", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                    help="bisect between the last passing and first failing rate (default 3 steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between runs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may stay silent")
    ap.add_argument("--json", help="write the config, every run and every request here")
    ap.add_argument("--plot", metavar="PREFIX", help="write PREFIX_latency.png and PREFIX_attainment.png")
    cmp = ap.add_argument_group("aggregated vs disaggregated (bench/compare.py)")
    cmp.add_argument("--compare", action="store_true", help="start both deployments in turn and bench each")
    cmp.add_argument("--cores", type=int, help="workers in each deployment (one core each)")
    cmp.add_argument("--prefill-workers", type=int, default=1, help="prefill workers of the disaggregated one")
    cmp.add_argument("--dtype", default="auto")
    cmp.add_argument("--port", type=int, default=8000, help="the deployments' gateway port")
    return ap


def parse(argv: list[str] | None, prog: str = "pdserve bench") -> argparse.Namespace:
    ap = parser(prog)
    args = ap.parse_args(argv)
    if args.workload != "fixed" and (args.input_len is not None or args.output_len is not None):
        ap.error("--input-len/--output-len apply to --workload fixed only")
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else args.rate
    if rates is not None and not all(0 < r < math.inf for r in rates):
        ap.error("rates must be positive and finite (use --concurrency for a saturating load)")
    if args.concurrency is not None and min(args.concurrency) < 1:
        ap.error("--concurrency must be at least 1")
    if (args.num_requests is not None and args.num_requests < 1) or (args.duration is not None and args.duration <= 0):
        ap.error("--num-requests and --duration must be positive")
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    if args.compare and not args.cores:
        ap.error("--compare needs --cores N")
    args.loads = ([serving.Load(rate=r) for r in rates] if rates else
                  [serving.Load(concurrency=c) for c in args.concurrency] if args.concurrency else [serving.Load(rate=1.0)])
    return args


def main(argv: list[str] | None = None, prog: str = "pdserve bench") -> int:
    args = parse(argv, prog)
    if args.compare:
        return compare.run_compare(args)
    plan, tokenizer = serving.plan_of(args), serving.load_tokenizer(args)
    target = serving.Target(args.url.rstrip("/"), args.model, args.api_key, args.timeout)
    serving.warm_up(target, tokenizer)
    runs = serving.sweep(target, plan, args.loads, tokenizer, args.goodput_search)
    if args.json:
        Path(args.json).write_text(json.dumps(serving.result_json(serving.config_of(args, plan), runs), indent=1))
    if args.plot:
        from bench.plots import plot_runs

        for path in plot_runs({args.url: runs}, plan.slo, args.plot):
            _say(f"wrote {path}")
    print(f"\n{args.model} at {args.url}, workload {plan.workload}, seed {plan.seed}")
    print(serving.table(runs, plan.slo))
    return 0


if __name__ == "__main__":
    sys.exit(main())  # `pdserve bench` runs this: the same command by either name
