"""Offline throughput, pdserve vs transformers, and decode step time against the roofline.

    python -m bench.offline [--num-requests 64] [--threads 2] [--dtype bfloat16,float32] [--json out.json]

One run measures, side by side on this machine: (1) the copy bandwidth and matmul rates
that make the roofline, (2) pdserve's `LLM.generate` over a ShareGPT-like workload
(continuous batching, up to --max-num-seqs sequences at once), (3) the mean engine step
while B sequences all decode, and (4) transformers' `generate` over the same requests in
static batches of --hf-batch, in arrival order. Every request generates exactly its drawn
output length in both systems (ignore_eos / min_new_tokens); transformers runs each batch
to its longest request, and only the tokens requests asked for are counted, so that
waste is what static batching costs. Progress goes to stderr, the table to stdout.

Each dtype of --dtype (default: both bfloat16 and float32, one after the other in one run)
gets the whole measurement, and the host's CPU (its ISA: AMX-BF16, AVX512, AVX2...) and
what `auto` picks on it head the output: the host is part of every figure's conditions.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from bench.roofline import DecodeResult, MachineRates, measure_decode
from common.model_source import resolve_model
from deploy.planner.workload import Request, sharegpt_requests
from engine import LLM, SamplingParams
from engine.config import ModelConfig, resolve_dtype
from kernels.dtype_choice import auto_dtype
from kernels.host import cpu


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ThroughputResult:
    system: str
    seconds: float
    prompt_tokens: int
    output_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens actually generated (static batching pads to the batch max)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def warm_prompts(tokenizer) -> list[list[int]]:
    """Short prompts outside the workload's corpus, so warm-up leaves no prefix-cache hits."""
    return [tokenizer.encode(f"Warm-up number {i}: a short line to touch every kernel once.",
                             add_special_tokens=False) for i in range(2)]


def run_ours(llm: LLM, requests: list[Request]) -> ThroughputResult:
    """Time one `LLM.generate` call over all requests (continuous batching)."""
    llm.generate(warm_prompts(llm.tokenizer), greedy(4))
    prompts = [r.prompt_token_ids for r in requests]
    params = [greedy(r.output_len) for r in requests]
    log(f"pdserve: generate({len(requests)} requests)")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)  # the whole call is timed, detokenization included
    seconds = time.perf_counter() - t0
    for r, o in zip(requests, outs):
        if len(o.token_ids) != r.output_len:
            raise RuntimeError(f"{o.request_id}: {len(o.token_ids)} tokens, asked for {r.output_len}")
    cached = sum(o.num_cached_tokens for o in outs)
    log(f"pdserve: {seconds:.1f}s, {cached} prompt tokens from the prefix cache")
    out_tokens = sum(r.output_len for r in requests)
    return ThroughputResult("pdserve", seconds, sum(len(p) for p in prompts), out_tokens, out_tokens)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, as a tokenizer with padding_side='left' gives."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def run_transformers(path, dtype: torch.dtype, requests: list[Request], batch_size: int,
                     warm: list[list[int]]) -> ThroughputResult:
    """Static batches in arrival order; each batch generates its longest request's length."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else (
        eos[0] if isinstance(eos, list) else eos)

    def generate(prompts: list[list[int]], new: int) -> None:
        ids, mask = left_pad(prompts, pad)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
        if out.shape[1] != ids.shape[1] + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked {new}")

    generate(warm, 4)
    generated, t0 = 0, time.perf_counter()
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        new = max(r.output_len for r in chunk)
        generate([r.prompt_token_ids for r in chunk], new)
        generated += new * len(chunk)
        log(f"transformers: batch {start // batch_size + 1}/{math.ceil(len(requests) / batch_size)} "
            f"({len(chunk)} x {new} new tokens) done at {time.perf_counter() - t0:.1f}s")
    return ThroughputResult("transformers", time.perf_counter() - t0,
                            sum(len(r.prompt_token_ids) for r in requests),
                            sum(r.output_len for r in requests), generated)


def render(args, conditions: dict, results: list[ThroughputResult], decodes: list[DecodeResult],
           rates: MachineRates) -> str:
    """The final table as text."""
    c = conditions
    lines = [
        f"pdserve offline benchmark: {c['model']}, {c['dtype']}, threads {c['threads']}, torch {c['torch']}, "
        f"host {c['host']}"
        + (f", transformers {c['transformers']}" if c["transformers"] else ""),
        f"workload: {c['num_requests']} ShareGPT-like requests (seed {c['seed']}), prompt tokens "
        f"{c['prompt_tokens']} (mean {c['prompt_mean']:.0f}, max {c['prompt_max']}), output tokens "
        f"{c['output_tokens']} (mean {c['output_mean']:.0f}, max {c['output_max']}), greedy, ignore_eos",
        "",
        f"{'throughput':<44}{'seconds':>9}{'output tok/s':>14}{'total tok/s':>13}",
    ]
    labels = {"pdserve": f"pdserve (continuous, <= {args.max_num_seqs} seqs at once)",
              "transformers": f"transformers (static batches of {args.hf_batch})"}
    for r in results:
        lines.append(f"{labels[r.system]:<44}{r.seconds:>9.1f}{r.output_tps:>14.1f}{r.total_tps:>13.1f}")
    if len(results) == 2:
        ours, hf = results
        lines.append(f"{'ratio pdserve / transformers':<44}{'':>9}"
                     f"{ours.output_tps / hf.output_tps:>13.2f}x{ours.total_tps / hf.total_tps:>12.2f}x")
        waste = 1 - hf.output_tokens / hf.generated_tokens
        lines.append(f"(transformers generated {hf.generated_tokens} tokens, {waste:.0%} of them past a "
                     "request's length: each static batch runs to its longest request; only requested "
                     "tokens are counted)")
    else:
        lines.append("(transformers skipped: --skip-hf)")
    lines += ["", f"decode step, prompt {args.decode_ctx} tokens, mean over steps where all B decode",
              f"{'B':>4}{'steps':>7}{'context':>9}{'ours ms':>9}{'median':>8}{'roofline ms':>13}"
              f"{'bound':>9}{'ours/roof':>11}{'shape roof ms':>15}{'ours/shape':>12}"]
    for d in decodes:
        rl = d.roofline
        lines.append(f"{d.batch:>4}{d.steps:>7}{d.context:>9.0f}{d.mean_s * 1e3:>9.1f}{d.median_s * 1e3:>8.1f}"
                     f"{rl.seconds * 1e3:>13.2f}{rl.bound:>9}{d.mean_s / rl.seconds:>10.1f}x"
                     f"{rl.shape_seconds * 1e3:>15.2f}{d.mean_s / rl.shape_seconds:>11.1f}x")
    at = ", ".join(f"B={b}: {r / 1e9:.0f}" for b, r in rates.matmul_at_batch.items())
    lines += [
        f"machine: copy {rates.bandwidth / 1e9:.1f} GB/s (read + write, {args.copy_mib} MiB), {c['dtype']} "
        f"matmul {rates.matmul_peak / 1e9:.0f} GFLOP/s at [1024 x hidden] x [hidden x ffn], {at} GFLOP/s "
        "at [B x hidden] x [hidden x ffn]",
        "roofline = max(weights + KV bytes / copy bandwidth, flops / peak matmul rate); "
        "shape roof uses the matmul rate at the decode shape instead of the peak",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or Hugging Face folder")
    p.add_argument("--dtype", default="bfloat16,float32",
                   help="comma-separated dtypes, each measured in turn ('auto' allowed); default both")
    p.add_argument("--threads", type=int, default=2, help="torch threads, both systems")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input", type=int, default=1024, help="prompt length cap")
    p.add_argument("--max-output", type=int, default=512, help="output length cap")
    p.add_argument("--max-num-seqs", type=int, default=64, help="pdserve's concurrent sequence cap")
    p.add_argument("--hf-batch", type=int, default=32, help="transformers static batch size")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--decode-ctx", type=int, default=256, help="prompt tokens for the decode step test")
    p.add_argument("--decode-batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--decode-steps", type=int, default=16, help="all-decode steps to aim for")
    p.add_argument("--copy-mib", type=int, default=256, help="tensor size for the bandwidth test")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    auto, why = auto_dtype()
    host = dict(cpu=cpu().describe(), isa=cpu().isa, auto_dtype=str(auto).removeprefix("torch."), auto_reason=why)
    log(f"host: {host['cpu']}; dtype auto here: {host['auto_dtype']} ({why})")
    runs = []
    for name in [d.strip() for d in args.dtype.split(",") if d.strip()]:
        runs.append(run_dtype(args, name, host))
    if len(runs) > 1:
        print(f"\nhost: {host['cpu']}; auto = {host['auto_dtype']}")
        first = runs[0]
        for other in runs[1:]:
            a, b = first["throughput"][0], other["throughput"][0]
            line = (f"{other['conditions']['dtype']} / {first['conditions']['dtype']}: offline output tok/s "
                    f"{b['output_tps'] / a['output_tps']:.2f}x")
            for da, db in zip(first["decode"], other["decode"]):
                line += f"; decode step at B={da['batch']} {db['mean_s'] / da['mean_s']:.2f}x"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(host=host, runs=runs), f, indent=2)
        log(f"wrote {args.json}")


def run_dtype(args: argparse.Namespace, dtype_name: str, host: dict) -> dict:
    """The whole measurement in one dtype; prints its table, returns its figures."""
    dtype, _ = resolve_dtype(dtype_name)
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    path = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(path)

    log(f"measuring copy bandwidth and {dtype} matmul rates")
    rates = MachineRates.measure(cfg, dtype, batches, copy_mib=args.copy_mib)
    log(f"loading pdserve LLM ({path.name}, {dtype}, {args.threads} threads)")
    llm = LLM(model=str(path), dtype=dtype, num_threads=args.threads, max_num_seqs=args.max_num_seqs)
    requests = sharegpt_requests(llm.tokenizer, args.num_requests, args.seed, args.max_input, args.max_output)
    results = [run_ours(llm, requests)]

    decodes = []
    for b in batches:
        log(f"decode step: batch {b}, prompt {args.decode_ctx}")
        decodes.append(measure_decode(llm, cfg, dtype, rates, b, args.decode_ctx, args.decode_steps,
                                      seed=args.seed + b))
    warm = warm_prompts(llm.tokenizer)
    del llm
    gc.collect()  # free pdserve's weights and KV pool before transformers loads

    if not args.skip_hf:
        log(f"transformers: {math.ceil(len(requests) / args.hf_batch)} static batches of {args.hf_batch}")
        results.append(run_transformers(path, dtype, requests, args.hf_batch, warm))

    ins = [len(r.prompt_token_ids) for r in requests]
    outs = [r.output_len for r in requests]
    conditions = dict(
        model=cfg.name, dtype=str(dtype).removeprefix("torch."), threads=args.threads,
        torch=torch.__version__, num_requests=len(requests), seed=args.seed,
        prompt_tokens=sum(ins), prompt_mean=statistics.fmean(ins), prompt_max=max(ins),
        output_tokens=sum(outs), output_mean=statistics.fmean(outs), output_max=max(outs),
        max_num_seqs=args.max_num_seqs, hf_batch=None if args.skip_hf else args.hf_batch,
        transformers=None if args.skip_hf else importlib.metadata.version("transformers"),
        host=host["cpu"], isa=host["isa"],
    )
    print(render(args, conditions, results, decodes, rates) + "\n")
    gc.collect()
    return dict(
        conditions=conditions,
        throughput=[dict(asdict(r), output_tps=r.output_tps, total_tps=r.total_tps) for r in results],
        decode=[dict(asdict(d), roofline_s=d.roofline.seconds, shape_roofline_s=d.roofline.shape_seconds)
                for d in decodes],
        machine=asdict(rates),
    )


if __name__ == "__main__":
    main()
