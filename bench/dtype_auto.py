"""What `dtype: auto` picks on this host, against both dtypes' generation throughput.

    python -m bench.dtype_auto [--threads 2] [--num-requests 32] [--rounds 2] [--json out.json]

One run, side by side: (1) the dtype calibration (kernels/dtype_calibration.py), forced
and fresh (not read from the cache), with its rates and verdict, and what `auto` itself
chooses here (on a CPU with native bf16: bf16, nothing measured); (2) `LLM(model=...)`
in bfloat16 and in float32 over the same ShareGPT-like workload (greedy, `ignore_eos`,
no prefix cache), the dtypes taking turns for --rounds rounds so that drift on a shared
host falls on both, each keeping its fastest round. The last line says whether the calibration's verdict is the dtype
that generated faster, and at what fraction of the faster one `auto` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.offline import greedy, log, warm_prompts
from deploy.planner.workload import sharegpt_requests
from engine import LLM
from kernels.dtype_choice import CalibrationMode, choose, decide
from kernels.host import cpu

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.dtype_auto", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or Hugging Face folder")
    p.add_argument("--threads", type=int, default=2, help="torch threads (calibration and generation)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input", type=int, default=512, help="prompt length cap")
    p.add_argument("--max-output", type=int, default=256, help="output length cap")
    p.add_argument("--rounds", type=int, default=2, help="generate calls per dtype, the dtypes taking turns")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log(f"host: {cpu().describe()}")
    with tempfile.TemporaryDirectory() as tmp:  # a fresh measurement, the user's cache untouched
        forced = choose(CalibrationMode.ALWAYS, Path(tmp) / "dtype.json")
    m = forced.measurement
    verdict, why = decide(m)
    auto = choose()
    log(f"calibration ({m.seconds:.2f} s): {why}")

    llms = {name: LLM(model=args.model, dtype=dtype, num_threads=args.threads, enable_prefix_caching=False)
            for name, dtype in DTYPES.items()}
    requests = sharegpt_requests(llms["float32"].tokenizer, args.num_requests, args.seed, args.max_input,
                                 args.max_output)
    prompts = [r.prompt_token_ids for r in requests]
    params = [greedy(r.output_len) for r in requests]
    out_tokens = sum(r.output_len for r in requests)
    tps: dict[str, list[float]] = {name: [] for name in DTYPES}
    for llm in llms.values():
        llm.generate(warm_prompts(llm.tokenizer), greedy(4))
    for r in range(args.rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            tps[name].append(out_tokens / (time.perf_counter() - t0))
            log(f"round {r + 1}: {name} {tps[name][-1]:.1f} output tok/s")

    # Each dtype's fastest round (the least disturbed on a shared host), as the calibration does.
    best = {name: max(v) for name, v in tps.items()}
    mean = {name: statistics.fmean(v) for name, v in tps.items()}
    faster = max(best, key=best.__getitem__)
    auto_name = str(auto.dtype).removeprefix("torch.")
    verdict_name = str(verdict).removeprefix("torch.")
    print(f"\nhost: {cpu().describe()}; torch {torch.__version__}")
    print(f"workload: {len(requests)} requests, {sum(len(p) for p in prompts)} prompt and {out_tokens} output "
          f"tokens, greedy, ignore_eos, no prefix cache; {args.rounds} rounds, dtypes in turn")
    print(f"calibration ({m.seconds:.2f} s, forced): {why} -> {verdict_name}")
    print(f"dtype auto here: {auto_name} ({auto.source.value}: {auto.reason})")
    for name, values in tps.items():
        print(f"LLM generate {name:<9} output tok/s: " + ", ".join(f"{v:.1f}" for v in values)
              + f" (best {best[name]:.1f}, mean {mean[name]:.1f})")
    print(f"bfloat16 / float32 generation, best rounds: {best['bfloat16'] / best['float32']:.2f}x (means: "
          f"{mean['bfloat16'] / mean['float32']:.2f}x; calibration: {m.ratio:.2f}x, median repeats "
          f"{m.median_ratio:.2f}x); faster: {faster}; calibration verdict "
          f"{'agrees' if verdict_name == faster else 'DISAGREES'}; auto runs at "
          f"{best[auto_name] / best[faster]:.2f}x of the faster dtype")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            host=cpu().describe(), torch=torch.__version__, threads=args.threads,
            calibration=dict(bf16=vars(m.bf16), float32=vars(m.float32), seconds=m.seconds, ratio=m.ratio,
                             median_ratio=m.median_ratio, verdict=verdict_name),
            auto=dict(dtype=auto_name, source=auto.source.value, reason=auto.reason),
            generate_output_tps=tps), indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
