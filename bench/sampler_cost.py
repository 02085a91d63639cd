"""What drawing a token at temperature > 0 costs on this CPU, per step, before and after.

    python -m bench.sampler_cost [--batches 1,8,16,32] [--steps 40] [--json out.json]

Side by side in one run, each variant in its own process (the allocator setting is
process-wide), one torch thread, [batch, 49152] bfloat16 logits (SmolLM2's vocabulary),
median ms per sampler call:
- greedy: the argmax, the floor;
- race: temperature 1 by the exponential race, argmax(probs / E) with a vocabulary of
  Exp(1) draws per row (how unseeded rows were sampled before);
- inverse CDF: temperature 1 as engine/sampler.py samples unseeded rows now, one uniform
  draw per row, with glibc's default allocator;
- inverse CDF, kept: the same with engine/host_memory.py's setting (what an engine sets),
  freed step memory reused instead of faulted in again.
The host's ISA heads the output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = ("greedy", "race", "inverse CDF", "inverse CDF, kept")


def measure(variant: str, batches: list[int], steps: int) -> dict[int, float]:
    """In this process: median ms per call of `variant` at each batch."""
    import torch

    from bench.cpu_attention import median_seconds
    from common.sampling_params import SamplingParams
    from engine.host_memory import keep_freed_memory
    from engine.sampler import Sampler, SamplingMetadata, process_logits, sampling_probs

    torch.set_num_threads(1)
    if variant.endswith("kept"):
        keep_freed_memory()
    vocab = 49152
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = {}
    for b in batches:
        logits = torch.randn(b, vocab, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(b))
        params = SamplingParams(temperature=0.0 if variant == "greedy" else 1.0)
        meta = SamplingMetadata.build([params] * b, [[1]] * b, [[]] * b, vocab, "cpu")

        def race() -> list[int]:
            probs = sampling_probs(process_logits(logits, meta), meta)
            exp = torch.empty_like(probs).exponential_(generator=sampler.generator)
            return (probs / exp.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1).tolist()

        call = race if variant == "race" else (lambda: sampler(logits, meta))
        out[b] = median_seconds(call, steps) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if args.variant:
        print(json.dumps(measure(args.variant, batches, args.steps)))
        return 0
    from kernels.host import cpu

    results = {}
    for variant in VARIANTS:
        print(f"[sampler-cost] {variant} ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "bench.sampler_cost", "--variant", variant, "--batches",
                               args.batches, "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        results[variant] = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    print(f"host: {cpu().describe()}; one thread, [batch, 49152] bfloat16 logits, median ms per call")
    print(f"{'batch':>5} " + " ".join(f"{v:>18}" for v in VARIANTS) + f" {'race / kept':>12}")
    for b in batches:
        row = [results[v][b] for v in VARIANTS]
        print(f"{b:>5} " + " ".join(f"{x:>18.2f}" for x in row) + f" {row[1] / row[3]:>11.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": cpu().describe(), "ms_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
