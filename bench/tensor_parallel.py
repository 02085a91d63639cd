"""Tensor parallelism on this host's CPU: one rank with every core against N ranks with a
share of them each, side by side in one run, and what the collectives cost.

    python -m bench.tensor_parallel [--quick] [--dtype float32,bfloat16] [--batches 1,8,32,64]
        [--degree 2] [--threads 2] [--context 256] [--rounds 6] [--steps 8] [--chunk 512]
        [--chunks 2] [--smollm2] [--out bench/results/tensor_parallel.json]

A is `LLMEngine` at tensor_parallel_size 1 with --threads torch threads; B the same engine
at --degree ranks (gloo over loopback, engine/parallel/) with --threads / --degree threads
each: the same cores in all. The model is a random-weight checkpoint of SmolLM2-135M's
size (bench/harness/tiny_models.py SMOLLM2_SHAPE) with 8 query and 4 KV heads of 64 dims,
which degree 2 divides (SmolLM2's own 9 / 3 heads allow degrees 1 and 3 only); its
attention has SmolLM2's parameter count exactly and the same head_dim, so the same
kernels run. `--smollm2` adds SmolLM2 itself at degree 3 with one thread per rank, three
processes on two cores: oversubscribed, labelled so.

Both engines live in this process and are driven by `schedule()` / `execute()` directly;
each is measured in turn, A B A B, --rounds times (background load hits both alike):
- the decode step (the whole engine step: schedule, forward, sample, bookkeeping) while
  every one of B sequences decodes, --steps steps per round, at each batch size;
- prefill throughput: --chunks prompts of --chunk tokens per round, each one step;
- on each rank of B, the share of its forward passes spent inside collectives, from the
  group's clock table (engine/parallel/rank_clock.py), read around each round once every
  follower has recorded its last step (a follower records just after rank 0 returns).
Before the engines load, the collectives alone: --degree processes with one thread each
time gloo's all-reduce of the hidden state and the all-gather of the logits at each
shape, the floor under what a step's 2 x layers + 2 collectives can cost.

Each dtype of --dtype (default float32, and bfloat16 where the CPU computes it natively)
gets the whole measurement. The table names the host's CPU (lscpu) and kernels; the JSON
goes to --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import host_steal
from bench.harness.tiny_models import SMOLLM2_SHAPE, write_sized_checkpoint
from bench.harness.worker_procs import REPO
from bench.host_cpu import host_cpu
from common.model_source import resolve_model
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.parallel.follower import join_group
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.rank_clock import RankTime
from kernels import get_ops
from kernels.host import cpu

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64  # the sized model's: 8 x 64 = 512 query dims, SmolLM2's attention parameters
FLOOR_ITERS = 200


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def host() -> dict:
    """This host's CPU as lscpu names it, and what pdserve runs on it."""
    caps, lscpu = cpu(), host_cpu()
    return dict(cpu=lscpu.name if lscpu.name != "unknown" else caps.model_name, family=lscpu.family,
                model=lscpu.model, cores=len(os.sched_getaffinity(0)), isa=caps.isa,
                native_bf16=caps.native_bf16, kernels=type(get_ops("cpu")).__name__,
                native_matmul=get_ops("cpu").matmul_library() is not None, torch=torch.__version__)


# -- the collectives alone -------------------------------------------------------------------

def _floor_rank(rank: int, size: int, rendezvous: str, hidden: int, vocab_rows: int, dtype: torch.dtype,
                rows: list[int], sampled: list[int], iters: int, results) -> None:
    torch.set_num_threads(1)
    join_group(rendezvous, size, rank)
    import torch.distributed as dist

    def timed(name: str, run) -> None:
        for _ in range(max(1, iters // 10)):
            run()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        timings[name] = (time.perf_counter() - t0) / iters

    timings = {}
    for n in rows:
        x = torch.randn(n, hidden).to(dtype)  # [rows, hidden]: a row-parallel layer's partial sum
        timed(f"all_reduce/{n}", lambda: dist.all_reduce(x))
    for n in sampled:
        logits = torch.randn(n, vocab_rows)  # [sampled rows, this rank's vocabulary rows] float32
        parts = [torch.empty_like(logits) for _ in range(size)]
        timed(f"all_gather/{n}", lambda: dist.all_gather(parts, logits))
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def collective_floor(size: int, cfg: ModelConfig, dtype: torch.dtype, rows: list[int], sampled: list[int],
                     iters: int) -> dict:
    """Microseconds per call of the hidden-state all-reduce at each of `rows` and of the
    logits' all-gather at each of `sampled`, `size` processes of one thread each calling
    them back to back with nothing else to do."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    vocab_rows = TensorParallelLayout.of(cfg, size, 0).vocab_rows_max
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-floor-") as d:
        procs = [ctx.Process(target=_floor_rank, args=(r, size, f"{d}/rendezvous", cfg.hidden_size, vocab_rows,
                                                       dtype, rows, sampled, iters, results))
                 for r in range(size)]
        for p in procs:
            p.start()
        timings = results.get(timeout=600)
        for p in procs:
            p.join(60)
    return dict(all_reduce_us={str(n): timings[f"all_reduce/{n}"] * 1e6 for n in rows},
                all_gather_us={str(n): timings[f"all_gather/{n}"] * 1e6 for n in sampled})


# -- the engines ------------------------------------------------------------------------------

@dataclass
class Side:
    tp: int
    threads: int  # per rank
    engine: LLMEngine
    ranks: list[RankTime] = field(default_factory=list)  # summed over the measured rounds

    @property
    def label(self) -> str:
        return f"TP {self.tp} x {self.threads} thread{'s' if self.threads > 1 else ''}"

    def clocks(self) -> list[RankTime] | None:
        return self.engine.ranks.clocks.read() if self.engine.ranks is not None else None

    def add_window(self, before: list[RankTime] | None) -> None:
        """This round's forward passes and collectives on every rank, once each has recorded."""
        if before is None:
            return
        deadline = time.monotonic() + 5
        now = self.clocks()
        while len({t.steps for t in now}) > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
            now = self.clocks()
        window = [t.since(b) for t, b in zip(now, before)]
        self.ranks = window if not self.ranks else [
            RankTime(w.rank, w.steps + s.steps, w.step_s + s.step_s, w.collective_s + s.collective_s)
            for w, s in zip(window, self.ranks)]

    def take_ranks(self) -> list[dict]:
        out = [dict(rank=t.rank, steps=t.steps, forward_ms=t.step_s / t.steps * 1e3,
                    collective_ms=t.collective_s / t.steps * 1e3, collective_share=t.collective_s / t.step_s)
               for t in self.ranks if t.steps]
        self.ranks = []
        return out


def build(folder: Path, dtype: torch.dtype, tp: int, threads: int, num_blocks: int, sched: SchedulerConfig) -> Side:
    torch.set_num_threads(threads)  # the followers take rank 0's count as they start
    _say(f"loading TP {tp} x {threads} threads ({folder.name}, {dtype})")
    engine = LLMEngine.from_folder(folder, dtype, CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False),
                                   sched, tensor_parallel_size=tp)
    engine.warm_up()
    return Side(tp, threads, engine)


def _prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def _timed_step(engine: LLMEngine, tokens: int, seqs: int) -> float:
    t0 = time.perf_counter()
    stats = engine.execute(engine.schedule()).stats
    seconds = time.perf_counter() - t0
    if stats is None or stats.num_tokens != tokens or stats.num_seqs != seqs:
        raise RuntimeError(f"a measured step ran {stats}, not {seqs} sequences of {tokens} tokens in all")
    return seconds


def measure_decode(sides: list[Side], batch: int, context: int, rounds: int, steps: int, seed: int) -> dict:
    """Step times while all `batch` sequences decode, the sides in turn each round."""
    gen = torch.Generator().manual_seed(seed)
    vocab = sides[0].engine.config.model.vocab_size
    prompts = [_prompt(gen, context, vocab) for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps + 64, ignore_eos=True)
    for side in sides:  # every sequence prefilled and decoding before any step is timed
        torch.set_num_threads(side.threads)
        for i, p in enumerate(prompts):
            side.engine.add_request(f"d{batch}-{i}", p, params)
        warm = 0
        while warm < 2:  # two all-decode steps before the first measured one
            stats = side.engine.execute(side.engine.schedule()).stats
            warm = warm + 1 if stats.num_tokens == stats.num_seqs == batch else 0
    times: dict[str, list[float]] = {s.label: [] for s in sides}
    for _ in range(rounds):
        for side in sides:
            torch.set_num_threads(side.threads)
            before = side.clocks()
            times[side.label] += [_timed_step(side.engine, batch, batch) for _ in range(steps)]
            side.add_window(before)
    for side in sides:
        for i in range(batch):
            side.engine.abort_request(f"d{batch}-{i}")
    a, b = sides
    row = dict(batch=batch, context=context + 2 + rounds * steps / 2, steps=len(times[a.label]))
    for key, side in (("a", a), ("b", b)):
        row[f"{key}_mean_ms"] = statistics.fmean(times[side.label]) * 1e3
        row[f"{key}_median_ms"] = statistics.median(times[side.label]) * 1e3
    row["ratio"] = row["b_median_ms"] / row["a_median_ms"]
    row["ranks"] = b.take_ranks()
    a.take_ranks()
    return row


def measure_prefill(sides: list[Side], chunk: int, rounds: int, chunks: int, seed: int) -> dict:
    """Tokens/s of one `chunk`-token prompt per step (context 0), the sides in turn each round."""
    gen = torch.Generator().manual_seed(seed)
    vocab = sides[0].engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {s.label: [] for s in sides}
    for r in range(rounds):
        for side in sides:
            torch.set_num_threads(side.threads)
            before = side.clocks()
            for i in range(chunks):
                side.engine.add_request(f"p{r}-{i}", _prompt(gen, chunk, vocab), params)
                times[side.label].append(_timed_step(side.engine, chunk, 1))
                if side.engine.has_unfinished():
                    raise RuntimeError("a one-token prefill did not finish in its step")
            side.add_window(before)
    a, b = sides
    row = dict(chunk=chunk, chunks=len(times[a.label]))
    for key, side in (("a", a), ("b", b)):
        row[f"{key}_tok_s"] = chunk / statistics.median(times[side.label])
    row["ratio"] = row["b_tok_s"] / row["a_tok_s"]
    row["ranks"] = b.take_ranks()
    a.take_ranks()
    return row


def compare(args: argparse.Namespace, name: str, folder: Path, dtype: torch.dtype, degree: int,
            threads_b: int) -> dict:
    """Side A (TP 1, --threads threads) against side B (`degree` ranks of `threads_b`)."""
    cfg = ModelConfig.from_pretrained(folder)
    batches = [int(b) for b in args.batches.split(",") if b]
    sampled = sorted({*batches, 1})  # a decode step samples every row, a prefill step one
    _say(f"{name}, {dtype}: collectives alone, {degree} processes x 1 thread")
    floor = collective_floor(degree, cfg, dtype, sorted({*sampled, args.chunk}), sampled, args.floor_iters)
    bs = 16
    per_seq = -(-(args.context + args.rounds * args.steps + 70) // bs)
    num_blocks = max(max(batches) * per_seq, args.chunks * -(-args.chunk // bs)) + 8
    sched = SchedulerConfig(max_num_batched_tokens=max(args.chunk, max(batches)), max_num_seqs=max(batches),
                            max_model_len=cfg.max_model_len, long_prefill_token_threshold=args.chunk)
    a = build(folder, dtype, 1, args.threads, num_blocks, sched)
    b = build(folder, dtype, degree, threads_b, num_blocks, sched)
    load0, ticks0 = os.getloadavg()[0], host_steal.read()
    try:
        decode = []
        for batch in batches:
            _say(f"decode: batch {batch}, {args.rounds} rounds of {args.steps} steps each side")
            decode.append(measure_decode([a, b], batch, args.context, args.rounds, args.steps, seed=batch))
        _say(f"prefill: {args.rounds} rounds of {args.chunks} x {args.chunk} tokens each side")
        prefill = measure_prefill([a, b], args.chunk, args.rounds, args.chunks, seed=1)
        labels = (a.label, f"{b.label} per rank")
        # what else ran meanwhile: other processes' load makes a 2-thread rank wait on a descheduled thread
        conditions = dict(load_start=load0, load_end=os.getloadavg()[0],
                          steal=host_steal.fraction(ticks0, host_steal.read()))
    finally:
        b.engine.close()
        a.engine.close()
    return dict(model=name, dtype=str(dtype).removeprefix("torch."), layers=cfg.num_layers, hidden=cfg.hidden_size,
                a=dict(tp=1, threads=args.threads, label=labels[0]),
                b=dict(tp=degree, threads=threads_b, label=labels[1]),
                oversubscribed=degree * threads_b > args.threads, collectives_per_step=2 * cfg.num_layers + 2,
                decode=decode, prefill=prefill, floor=floor, conditions=conditions)


# -- the report ------------------------------------------------------------------------------

def render(h: dict, runs: list[dict]) -> str:
    lines = [f"host: {h['cpu']} (family {h['family']} model {h['model']}), {h['cores']} cores, {h['isa']}; "
             f"kernels {h['kernels']}{', native matmuls' if h['native_matmul'] else ''}; torch {h['torch']}"]
    for run in runs:
        n = run["collectives_per_step"]
        lines += ["", f"{run['model']}, {run['dtype']}: A = {run['a']['label']}, B = {run['b']['label']}"
                  + (" (oversubscribed: more threads than cores)" if run["oversubscribed"] else "")
                  + f"; medians, interleaved A B A B; {n} collectives a step (2 per layer, embedding, logits)",
                  f"load average {run['conditions']['load_start']:.1f} at the start, "
                  f"{run['conditions']['load_end']:.1f} at the end; steal {run['conditions']['steal'] or 0:.1%}",
                  f"{'decode B':>8}{'steps':>7}{'A ms':>8}{'B ms':>8}{'B/A':>7}"
                  + "".join(f"{f'r{r} fwd ms':>11}{f'r{r} coll ms':>12}{'share':>7}" for r in range(run["b"]["tp"]))
                  + f"{'us/coll':>9}{'floor us':>10}"]
        for d in run["decode"]:
            line = (f"{d['batch']:>8}{d['steps']:>7}{d['a_median_ms']:>8.1f}{d['b_median_ms']:>8.1f}"
                    f"{d['ratio']:>6.2f}x")
            for r in d["ranks"]:
                line += f"{r['forward_ms']:>11.1f}{r['collective_ms']:>12.2f}{r['collective_share']:>7.0%}"
            least = min(r["collective_ms"] for r in d["ranks"])
            b = str(d["batch"])
            floor_step = (n - 1) * run["floor"]["all_reduce_us"][b] + run["floor"]["all_gather_us"][b]
            lines.append(f"{line}{least * 1e3 / n:>9.0f}{floor_step / n:>10.0f}")
        p = run["prefill"]
        line = (f"{'prefill':>8}{p['chunks']:>7}{p['a_tok_s']:>8.0f}{p['b_tok_s']:>8.0f}{p['ratio']:>6.2f}x")
        for r in p["ranks"]:
            line += f"{r['forward_ms']:>11.1f}{r['collective_ms']:>12.2f}{r['collective_share']:>7.0%}"
        least = min(r["collective_ms"] for r in p["ranks"])
        floor_step = (n - 1) * run["floor"]["all_reduce_us"][str(p["chunk"])] + run["floor"]["all_gather_us"]["1"]
        lines.append(f"{line}{least * 1e3 / n:>9.0f}{floor_step / n:>10.0f}   (tok/s, {p['chunk']}-token chunks)")
    lines += ["", "B ms / A ms: the whole engine step; fwd: a rank's forward pass; coll: its time inside "
              "collectives (its wait for the other ranks included); us/coll: the rank that waits least, per "
              "collective; floor: the same collectives alone, one thread per process, nothing else running"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default=None,
                   help="comma-separated dtypes; default float32, and bfloat16 where the CPU computes it natively")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--degree", type=int, default=2, help="side B's tensor-parallel size")
    p.add_argument("--threads", type=int, default=2, help="side A's threads; side B's ranks share them")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    p.add_argument("--rounds", type=int, default=6, help="A B turns per measurement")
    p.add_argument("--steps", type=int, default=8, help="decode steps per side per round")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (prompt) tokens")
    p.add_argument("--chunks", type=int, default=2, help="prefill chunks per side per round")
    p.add_argument("--floor-iters", type=int, default=FLOOR_ITERS, help="calls per collective timed alone")
    p.add_argument("--layers", type=int, default=SMOLLM2_SHAPE["num_hidden_layers"],
                   help="the sized model's layers (fewer: a faster run, for tests)")
    p.add_argument("--smollm2", action="store_true",
                   help="also SmolLM2 itself at degree 3, one thread per rank (oversubscribed on 2 cores)")
    p.add_argument("--quick", action="store_true", help="float32, batches 1 and 8, short rounds")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/tensor_parallel[_quick].json)")
    args = p.parse_args(argv)
    if args.quick:  # short everything the command line left at its default
        quick = dict(dtype="float32", batches="1,8", context=32, rounds=2, steps=2, chunk=128, chunks=1, floor_iters=20)
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    name = "tensor_parallel_quick.json" if args.quick else "tensor_parallel.json"
    args.out = args.out or str(REPO / "bench" / "results" / name)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h = host()
    _say(f"host: {h['cpu']}, {h['cores']} cores, {h['isa']}, kernels {h['kernels']}")
    dtypes = [resolve_dtype(d.strip())[0] for d in (args.dtype or "float32,bfloat16").split(",") if d.strip()]
    if args.dtype is None and not h["native_bf16"]:
        dtypes = [torch.float32]
        _say("no native bf16 on this CPU: float32 only (--dtype bfloat16 measures it anyway)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-bench-") as tmp:
        _say(f"writing a random checkpoint of SmolLM2's size, {args.layers} layers")
        sized = write_sized_checkpoint(Path(tmp) / "sized", HEADS, KV_HEADS, HEAD_DIM, num_hidden_layers=args.layers)
        name = f"random SmolLM2-size, {HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}"
        for dtype in dtypes:
            runs.append(compare(args, name, sized, dtype, args.degree, max(1, args.threads // args.degree)))
        if args.smollm2:
            for dtype in dtypes:
                runs.append(compare(args, "SmolLM2-135M", resolve_model("smollm2"), dtype, 3, 1))
    print(render(h, runs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    said = dict(vars(args), out=os.path.relpath(args.out, REPO) if Path(args.out).is_relative_to(REPO) else args.out)
    Path(args.out).write_text(json.dumps(dict(host=h, args=said, runs=runs), indent=2))
    _say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
