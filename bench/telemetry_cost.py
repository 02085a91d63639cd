"""What metrics and tracing cost: serving throughput with them on and off, in one run.

    python -m bench.telemetry_cost [--dtype auto] [--rounds 2] [--concurrency 16] \\
        [--num-requests 64] [--json out.json]

1. End to end: `pdserve serve` 1P+1D on 2 cores (bench/compare.py's deployment), the same
   closed-loop load through the gateway (fixed 128/64 tokens, `pdserve bench`'s client),
   with the per-request trace events and per-step engine metrics on (the default) and off
   (PDSERVE_TRACE=0, PDSERVE_STEP_METRICS=0), alternating on/off for --rounds rounds so a
   drift of the host hits both alike. Output tokens/s of each run and the on/off ratio.
2. In one process: the CPU time of one trace event and of one step's metric observation,
   against a decode step's duration measured in the same run, so the share is exact where
   the end-to-end ratio is within its noise.
As root on a machine with other interfaces, run it in a loopback-only network namespace:
    unshare -n -- sh -c 'ip link set lo up && python -m bench.telemetry_cost'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.compare import deployment, serve_command
from bench.serving import Plan, Target, run_one, warm_up
from bench.serving_metrics import SLO, Load

OFF = {"PDSERVE_TRACE": "0", "PDSERVE_STEP_METRICS": "0"}


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def end_to_end(args, tokenizer, logs: Path) -> list[dict]:
    plan = Plan("fixed", {"input_len": 128, "output_len": 64}, args.num_requests, None, SLO(10.0, 1.0), seed=0)
    runs = []
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            saved = {k: os.environ.get(k) for k in OFF}
            if mode == "off":
                os.environ.update(OFF)
            try:
                with deployment(serve_command(args.model, args.dtype, 1, 1, args.port, 2), args.port,
                                logs / f"serve-{r}-{mode}.log") as url:
                    target = Target(url, args.model, None, 600.0)
                    warm_up(target, tokenizer)
                    run = run_one(target, plan, Load(concurrency=args.concurrency), tokenizer, r)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            tps = run.summary["output_throughput"]
            _say(f"round {r + 1} telemetry {mode}: {tps:.1f} output tok/s ({run.summary['ok']} ok)")
            runs.append({"round": r + 1, "telemetry": mode, "output_tok_s": tps, "ok": run.summary["ok"],
                         "itl_p50_s": run.summary["itl_s"]["p50"], "ttft_p50_s": run.summary["ttft_s"]["p50"]})
    return runs


def in_process(args) -> dict:
    """One trace event and one step observation, timed against a decode step of batch 16."""
    import torch

    from common import trace
    from common.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.llm_engine import StepStats
    from worker import metrics

    torch.set_num_threads(1)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=1, enable_prefix_caching=False)
    eng = llm.engine
    scheduled = []  # each step's scheduler output, for the observation below
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda *a, **k: scheduled.append(schedule(*a, **k)) or scheduled[-1]
    for i in range(16):
        eng.add_request(f"r{i}", list(range(100 + i, 228 + i)), SamplingParams(max_tokens=64, ignore_eos=True))
    outs = []
    for _ in range(12):  # the prompts, then decode
        eng.step()
    for _ in range(20):
        t0 = time.perf_counter()
        eng.step()
        outs.append(time.perf_counter() - t0)
    step_s = statistics.median(outs)
    sched = scheduled[-1]  # a real decode batch of 16
    stats = StepStats(num_tokens=16, num_seqs=16, seconds=step_s)

    handler = logging.FileHandler(os.devnull)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger(trace.LOGGER_NAME).addHandler(handler)
    logging.getLogger(trace.LOGGER_NAME).setLevel(logging.INFO)
    trace.set_process("decode", "bench")
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        trace.event("cmpl-0123456789abcdef01234567", "kv_ready", blocks=8, prefill_worker="127.0.0.1:50051",
                    prefill_queue_s=0.0012, prefill_compute_s=0.0853, prefill_push_s=0.0167)
    event_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        metrics.observe_step(sched, stats)
    observe_s = (time.perf_counter() - t0) / n
    # Per request: ~6 events on the decode worker, ~5 on the gateway, ~5 on the prefill worker.
    return {"decode_step_b16_s": step_s, "trace_event_s": event_s, "observe_step_s": observe_s,
            "observe_share_of_step": observe_s / step_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--skip-serving", action="store_true", help="only the in-process costs")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from common.model_source import resolve_model
    from common.tokenizer import Tokenizer
    from kernels.host import cpu

    isa = cpu().describe()
    _say(f"host: {isa}")
    tokenizer = Tokenizer.from_pretrained(resolve_model(args.model))
    result = {"host": isa, "dtype": args.dtype, "concurrency": args.concurrency, "num_requests": args.num_requests}
    if not args.skip_serving:
        runs = end_to_end(args, tokenizer, Path(tempfile.mkdtemp(prefix="pdserve-telemetry-")))
        on = [r["output_tok_s"] for r in runs if r["telemetry"] == "on"]
        off = [r["output_tok_s"] for r in runs if r["telemetry"] == "off"]
        result.update(runs=runs, on_tok_s=statistics.mean(on), off_tok_s=statistics.mean(off),
                      on_over_off=statistics.mean(on) / statistics.mean(off))
    result.update(in_process(args))
    print(f"\nhost {isa}, dtype {args.dtype}")
    if "runs" in result:
        for r in result["runs"]:
            print(f"  round {r['round']} telemetry {r['telemetry']:>3}: {r['output_tok_s']:7.1f} output tok/s, "
                  f"ITL p50 {r['itl_p50_s'] * 1e3:.1f} ms")
        print(f"  on / off: {result['on_over_off']:.3f}x ({result['on_tok_s']:.1f} vs {result['off_tok_s']:.1f} tok/s)")
    print(f"  one trace event {result['trace_event_s'] * 1e6:.1f} us; one step's metrics "
          f"{result['observe_step_s'] * 1e6:.1f} us = {result['observe_share_of_step']:.3%} of a batch-16 decode step "
          f"({result['decode_step_b16_s'] * 1e3:.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
