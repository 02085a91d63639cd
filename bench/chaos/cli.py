"""The command line: `python -m bench.chaos` runs the chosen scenarios on their deployments
and prints the table."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.chaos.context import Chaos
from bench.chaos.deployment import Deployment
from bench.chaos.report import table
from bench.chaos.scenarios import OWN_DEPLOYMENT, SCENARIOS, SHARED_DEPLOYMENT
from bench.chaos.sizes import FULL, QUICK
from common import envs


def _say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    doc = sys.modules[__package__].__doc__  # the package's: its first paragraph says what this is
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=doc.split("\n\n")[0])
    ap.add_argument("--only", help=f"comma-separated scenarios, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--quick", action="store_true", help="the small sizes tests/e2e/test_chaos.py uses")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-factor", type=float, default=None,
                    help="make every engine step this many times slower (PDSERVE_FAULT_SLOW_FACTOR): a slower host")
    ap.add_argument("--decode-streams", choices=("worker", "request"), default="worker",
                    help="the gateway's way to its decode workers (YAML gateway.decode_streams): one Streams "
                         "call per worker (the default) or the earlier Generate call per request, to compare")
    args = ap.parse_args(argv)
    if args.slow_factor is not None:
        if args.slow_factor < 1:
            ap.error("--slow-factor must be at least 1")
        os.environ[envs.FAULT_SLOW_FACTOR] = str(args.slow_factor)  # every process of the deployment inherits it
    from kernels.host import cpu

    _say(f"host: {cpu().describe()}; engine steps stretched {envs.fault_slow_factor():g}x")
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    names = [n for n in SCENARIOS if n in names]  # the killers always last
    sizes = QUICK if args.quick else FULL
    results, trouble = [], []
    groups = [([n], OWN_DEPLOYMENT[n]) for n in names if n in OWN_DEPLOYMENT]
    groups.append(([n for n in names if n not in OWN_DEPLOYMENT], SHARED_DEPLOYMENT))
    for group, options in groups:
        if not group:
            continue
        if args.decode_streams != "worker":
            options = {**options, "gateway": {**options.get("gateway", {}), "decode_streams": args.decode_streams}}
        dep = Deployment(Path(tempfile.mkdtemp(prefix="pdserve-chaos-")), sizes, **options)
        _say(f"starting pdserve serve for {', '.join(group)}, TTFT bound {dep.max_ttft_s}, decode streams "
             f"{args.decode_streams} (log: {dep.log})")
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
        from kernels.host import cpu

        Path(args.json).write_text(json.dumps({"sizes": asdict(sizes), "host": cpu().describe(),
                                               "slow_factor": envs.fault_slow_factor(), "decode_streams": args.decode_streams,
                                               "results": [asdict(r) for r in results]}, indent=1, default=str))
    return 0 if not trouble and not any(r.problems() for r in results) else 1
