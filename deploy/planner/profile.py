"""`pdserve profile`: how long engine steps take on this hardware, for the planner.

Measures, with one worker's engine in this process (same threads and step budget as a
worker):
- prefill steps: chunks of T new tokens after `context` tokens already in the KV cache;
- decode steps: `batch` sequences each generating one token at a mean context length.

and fits two small cost models by least squares (non-negative coefficients):

    prefill_step(T, ctx)  = a + b*T + c*T*(ctx + T/2)      # linears + causal attention
    decode_step(B, ctx)   = a + b*B + c*B*ctx              # weights read once + KV read per sequence

A step that mixes both (aggregated serving) costs the decode model plus the prefill model
without its constant. The profile is a JSON file: the raw points and the coefficients.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deploy.planner.step_cost import StepCost, nnls, price
from deploy.planner.step_fit import LoopTerms

# `mixed_*`: the step model's points (deploy/planner/step_cost.py): B prompts of C tokens at once, run
# to a few tokens each (prefill chunks, then decodes), for every pair that fits the KV pool;
# then B sequences decoding while a long prompt is prefilled beside them in chunks.
# `decode_sweep`: for each mean context, as many sequences as fit decode together and finish
# one at a time, SWEEP_STEPS steps apart: pure decode steps at every batch size down to 1.
# `chunk_tokens`: a prompt's chunk of each size alone, then beside each `mixed_beside` batch of
# decodes, and as the tail after `chunk_after` cached tokens: the small chunks serving runs
# (short prompts, a long prompt's last chunk) at the same token counts as decode batches, so
# the fit can tell a token's cost from a decode sequence's (deploy/planner/step_cost.py).
FULL = {"prefill": [16, 64, 128, 256, 512], "long_prompt": 2048, "decode_batch": [1, 8, 32],
        "decode_context": [128, 896], "mixed_batch": [1, 4, 16, 32, 64], "mixed_context": [48, 400, 1200],
        "mixed_beside": [1, 8, 32], "decode_sweep": [160, 640],
        "chunk_tokens": [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384], "chunk_after": 1024}
QUICK = {"prefill": [32, 512], "long_prompt": 1024, "decode_batch": [1, 8], "decode_context": [128, 512],
         "mixed_batch": [1, 8], "mixed_context": [48, 400], "mixed_beside": [4], "decode_sweep": [160],
         "chunk_tokens": [16, 64], "chunk_after": 512}
SWEEP_STEPS = 3
MAX_SEQS = 64  # the profiled engine's max_num_seqs (the serving default)


@dataclass
class Profile:
    model: str
    dtype: str
    threads: int
    block_size: int
    max_num_batched_tokens: int
    kv_tokens: int  # KV capacity of one worker, in tokens
    prefill_points: list[list[float]] = field(default_factory=list)  # [tokens, context, seconds]
    decode_points: list[list[float]] = field(default_factory=list)  # [batch, context, seconds]
    prefill_coef: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    decode_coef: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    transfer_s: float = 0.004  # KV push per request (bench.transfer: ~3 ms for 2k SmolLM2 tokens)
    ttft_overhead_s: float = 0.0  # the serving path's latency to the client (HTTP, gRPC, routing); calibrated
    step_overhead_s: float = 0.0  # what serving adds to each decode step (streaming, contention); calibrated
    token_overhead_s: float = 0.0  # and per sequence in it (each token's message, detokenization, SSE); calibrated
    rpc_s: float = 0.001  # one gRPC message between processes (gateway -> decode, decode <-> prefill)
    # The step model fitted on mixed steps of the real runner (deploy/planner/step_cost.py: coefficients
    # in its NAMES order); empty: the two models above price a step.
    step_coef: list[float] = field(default_factory=list)
    step_points: list[list] = field(default_factory=list)  # [decode contexts, [[start, new], ...], sampled, seconds]
    step_error: list[float] = field(default_factory=list)  # held-out mean and p90 relative error of step_coef
    siblings: int = 0  # busy worker processes beside the measurement (`pdserve profile --siblings`)
    # Deployments' step costs per kind of worker, fitted on their step logs (deploy/planner/step_fit.py):
    # "aggregated" | "prefill" | "decode" -> [scale, fixed_s, per_sampled_s, per_token_rate, per_busy, per_row_s,
    # noise_sd, noise_s]
    # (step_fit.LoopTerms); where a kind has them, they price its iterations, at the deployment's
    # streamed tokens per second and as busy as the other workers are.
    loop_terms: dict[str, list[float]] = field(default_factory=dict)

    def prefill_step_s(self, tokens: int, context: int = 0, with_constant: bool = True) -> float:
        a, b, c = self.prefill_coef
        return (a if with_constant else 0.0) + b * tokens + c * tokens * (context + tokens / 2)

    def decode_step_s(self, batch: int, context: float) -> float:
        a, b, c = self.decode_coef
        return self.step_overhead_s + self.token_overhead_s * batch + a + b * batch + c * batch * context

    def step_s(self, shape, kind: str = "decode", token_rate: float = 0.0) -> float:
        """One engine step of `shape` (deploy.planner.sim_worker.StepShape) on a worker of `kind`
        (deploy/planner/step_fit.KINDS) beside idle workers: see step_parts."""
        engine_s, _, loop_s = self.step_parts(shape, kind, token_rate)
        return engine_s + loop_s

    def step_parts(self, shape, kind: str = "decode", token_rate: float = 0.0) -> tuple[float, float, float]:
        """A step of `shape` on a worker of `kind` as (engine seconds beside idle workers, the
        engine's extra seconds with the other workers busy throughout, the loop's own seconds).
        With that kind's loop terms, a whole loop iteration as the deployment measured it,
        while it streams `token_rate` tokens per second (deploy/planner/step_fit.py); else the fitted
        step model where the profile has one, else the decode model over its decodes at
        their mean context plus the prefill model per chunk (the step's constant once: with
        the decodes' if there are any, else with the first chunk's), neither shared nor
        looped. Serving's calibrated per-step overhead goes on steps that decode."""
        decodes = shape.decode_contexts
        terms = self.loop_terms.get(kind)
        if terms and self.step_coef:
            t, cost = LoopTerms.of(terms), price(self.step_coef, shape)
            return (t.engine_s(cost, shape.num_sampled, token_rate), cost * t.per_busy,
                    t.fixed_s + t.per_sampled_s * shape.num_sampled)
        if self.step_coef:
            serving = self.step_overhead_s + self.token_overhead_s * len(decodes) if decodes else 0.0
            return price(self.step_coef, shape) + serving, 0.0, 0.0
        cost = self.decode_step_s(len(decodes), statistics.fmean(decodes)) if decodes else 0.0
        for i, (start, new) in enumerate(shape.prefill_chunks):
            cost += self.prefill_step_s(new, start, with_constant=i == 0 and not decodes)
        return cost, 0.0, 0.0

    @property
    def noisy(self) -> bool:
        """Whether any kind's steps have noise (a simulation then depends on its seed)."""
        return any(LoopTerms.of(t).noise_sd > 0 for t in self.loop_terms.values())

    def step_noise(self, kind: str) -> tuple[float, float]:
        """(sd, time constant in seconds) of how a `kind` worker's steps stray from their price in a
        deployment (deploy/planner/step_fit.fit_noise); (0, 0) without that kind's loop terms."""
        terms = self.loop_terms.get(kind)
        if not terms:
            return 0.0, 0.0
        t = LoopTerms.of(terms)
        return t.noise_sd, t.noise_s

    def fit(self) -> Profile:
        self.prefill_coef = nnls([[1.0, t, t * (ctx + t / 2)] for t, ctx, _ in self.prefill_points],
                                  [s for *_, s in self.prefill_points])
        self.decode_coef = nnls([[1.0, b, b * ctx] for b, ctx, _ in self.decode_points],
                                 [s for *_, s in self.decode_points])
        return self

    def fit_error(self) -> tuple[float, float]:
        """Mean relative error of the fitted models on the measured points (prefill, decode)."""
        pre = [abs(self.prefill_step_s(t, c) - s) / s for t, c, s in self.prefill_points]
        dec = [abs(self.decode_step_s(b, c) - s) / s for b, c, s in self.decode_points]
        return statistics.fmean(pre), statistics.fmean(dec)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a pdserve profile ({e}); make one with `pdserve profile`") from None


def measure(model: str, dtype: str, threads: int, grid: dict, kv_memory_gib: float = 1.0,
            block_size: int = 16, max_num_batched_tokens: int = 512, say=print, siblings: int = 0) -> Profile:
    """`siblings`: busy worker processes beside the measurement (deploy/planner/profile_sibling.py),
    as many as a deployment runs beside each worker on the same machine."""
    with busy_siblings(model, dtype, threads, siblings, say):
        profile = _measure(model, dtype, threads, grid, kv_memory_gib, block_size, max_num_batched_tokens, say)
    profile.siblings = siblings
    return profile


@contextlib.contextmanager
def busy_siblings(model: str, dtype: str, threads: int, count: int, say) -> Iterator[None]:
    """`count` sibling workers busy for the duration (started and ready first, stopped after)."""
    procs = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deploy.planner.profile_sibling", "--model", model, "--dtype", dtype, "--threads",
                 str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)}))
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a profile sibling did not start (exit code {proc.wait()})")
        if procs:
            say(f"{count} busy sibling worker(s) beside the measurement")
        yield
    finally:
        for proc in procs:
            try:
                proc.stdin.close()  # its signal to stop
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


def _measure(model: str, dtype: str, threads: int, grid: dict, kv_memory_gib: float, block_size: int,
             max_num_batched_tokens: int, say) -> Profile:
    import torch

    from common.model_source import resolve_model
    from engine import LLMEngine, SamplingParams
    from engine.config import CacheConfig, ModelConfig, SchedulerConfig

    torch.set_num_threads(threads)
    path = resolve_model(model)
    model_len = ModelConfig.from_pretrained(path).max_model_len
    engine = LLMEngine.from_folder(path, dtype, CacheConfig(block_size, None, kv_memory_gib),
                                   SchedulerConfig(max_num_batched_tokens, MAX_SEQS, model_len))
    dtype = str(engine.config.dtype).removeprefix("torch.")  # what `auto` resolved to on this host
    profile = Profile(model, dtype, threads, block_size, max_num_batched_tokens,
                      engine.num_kv_blocks * block_size)
    vocab = engine.config.model.vocab_size
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:  # fresh ids each time: no prefix-cache hit
        k = next(counter)
        return [(k * 7919 + i * 104729) % (vocab - 200) + 100 for i in range(n)]

    def run(prompts: list[list[int]], max_tokens: int) -> list:
        """Run to completion; every step's (num_seqs, num_tokens, seconds, mean context)."""
        rids = [f"profile-{next(counter)}" for _ in prompts]
        done = dict.fromkeys(rids, 0)
        for rid, p in zip(rids, prompts):
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            context = statistics.fmean(len(p) + done[r] for r, p in zip(rids, prompts))
            t0 = time.perf_counter()  # the whole step: scheduling too
            result = engine.execute(engine.schedule())
            seconds = time.perf_counter() - t0
            for out in result.outputs:
                done[out.request_id] += len(out.token_ids)
            if result.stats is not None:
                steps.append((result.stats.num_seqs, result.stats.num_tokens, seconds, context))
        return steps

    run([prompt(64)], 2)  # warm-up
    for t in grid["prefill"]:
        times = [run([prompt(t)], 1)[0][2] for _ in range(3)]
        profile.prefill_points.append([t, 0, statistics.median(times)])
        say(f"prefill {t:5d} tokens: {statistics.median(times) * 1e3:7.1f} ms")
    long = grid["long_prompt"]  # chunked: each chunk attends to the ones before it
    for i, (_, tokens, seconds, _) in enumerate(run([prompt(long)], 1)):
        if tokens == max_num_batched_tokens:
            profile.prefill_points.append([tokens, i * max_num_batched_tokens, seconds])
    say(f"prefill {long} tokens in chunks of {max_num_batched_tokens}: "
        f"{sum(s for t, c, s in profile.prefill_points if c > 0) * 1e3:.0f} ms after the first chunk")
    for batch in grid["decode_batch"]:
        for ctx in grid["decode_context"]:
            steps = run([prompt(ctx) for _ in range(batch)], 6 + math.ceil(batch * ctx / max_num_batched_tokens))
            pure = [(s, c) for n, t, s, c in steps if n == batch and t == batch]
            profile.decode_points.append([batch, statistics.fmean(c for _, c in pure),
                                          statistics.median(s for s, _ in pure)])
            say(f"decode batch {batch:3d} at context {ctx:5d}: {profile.decode_points[-1][2] * 1e3:7.1f} ms/step")
    if "mixed_batch" in grid:
        measure_steps(engine, profile, grid, prompt, say)
    return profile.fit()


def measure_steps(engine, profile: Profile, grid: dict, prompt, say) -> None:
    """Every step of mixed workloads through the real engine, timed (schedule and execute,
    as a worker's iteration runs them) with its shape: the step model's points."""
    from deploy.planner.sim_worker import StepShape
    from engine import SamplingParams

    points: list[tuple[StepShape, float]] = []
    ids = iter(range(10**9))

    def add(requests: list[tuple[list[int], int]]) -> None:
        for p, n in requests:
            engine.add_request(f"steps-{next(ids)}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

    def step() -> StepShape:
        t0 = time.perf_counter()
        out = engine.schedule()
        engine.execute(out)
        shape = StepShape.of(out)
        if not out.is_empty:
            points.append((shape, time.perf_counter() - t0))
        return shape

    def run_all(requests: list[tuple[list[int], int]]) -> None:
        add(requests)
        while engine.has_unfinished():
            step()

    room = int(0.8 * profile.kv_tokens)
    for batch in grid["mixed_batch"]:
        for ctx in grid["mixed_context"]:
            if batch * (ctx + 8) <= room:
                run_all([(prompt(ctx), 8) for _ in range(batch)])
    for ctx in grid.get("decode_sweep", []):
        say(f"decode sweep at context ~{ctx}")
        run_all(_sweep(ctx, room, MAX_SEQS, profile.max_num_batched_tokens, prompt))
    long = grid["long_prompt"]
    for batch in grid["mixed_beside"]:  # decodes beside a long prompt's chunks, then alone
        if batch * 300 + long <= room:
            run_all([(prompt(200), 24 + long // profile.max_num_batched_tokens) for _ in range(batch)]
                    + [(prompt(long), 2)])
    sizes = grid.get("chunk_tokens", [])
    if sizes:
        say(f"prompt chunks of {sizes[0]}-{sizes[-1]} tokens alone, beside decodes, after {grid['chunk_after']} cached")
        for n in sizes:
            run_all([(prompt(n), 1)])
            run_all([(prompt(grid["chunk_after"] + n), 1)])  # chunks of the budget, then the n-token tail
        for batch in (b for b in grid["mixed_beside"] if b * 300 <= room):  # each size beside `batch` decodes
            add([(prompt(200), 2 * len(sizes) + math.ceil(batch * 200 / profile.max_num_batched_tokens) + 4)
                 for _ in range(batch)])
            while engine.has_unfinished() and step().prefill_chunks:  # until all of them decode
                pass
            for n in sizes:
                add([(prompt(n), 1)])
                step()
            run_all([])
    model = StepCost.fit(points)
    profile.step_coef = model.coef
    profile.step_error = [model.held_out_error, model.held_out_p90_error]
    profile.step_points = [[list(s.decode_contexts), [list(c) for c in s.prefill_chunks], s.num_sampled, t]
                           for s, t in points]
    say(f"step model: {len(points)} mixed steps, error on the 20% held out of the fit: mean "
        f"{model.held_out_error:.1%}, p90 {model.held_out_p90_error:.1%}")


def _sweep(ctx: int, room: int, max_seqs: int, budget: int, prompt) -> list[tuple[list[int], int]]:
    """Prompts of ctx/2 to 3ctx/2 tokens, as many as fit `room` (at most `max_seqs`), whose
    output lengths end them one at a time SWEEP_STEPS steps apart once all are decoding."""
    batch = max_seqs
    # A bound that errs large: every sequence counted at the longest prompt and about the
    # longest output (a few steps per sequence in the batch, plus the prefill's wait).
    while batch > 1 and batch * (ctx * 3 // 2 + batch * (SWEEP_STEPS + 1) + ctx // budget + 8) > room:
        batch -= 1
    lengths = [ctx // 2 + (ctx * i) // max(1, batch - 1) for i in range(batch)]
    prefill_steps = math.ceil(sum(lengths) / budget) + 2  # the first prompt waits this long for the last
    return [(prompt(n), prefill_steps + SWEEP_STEPS * (i + 1)) for i, n in enumerate(lengths)]


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure prefill and decode step times here, for the planner")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", help="auto (default: bfloat16 where the CPU computes it natively, "
                   "else float32), bfloat16 or float32: the dtype the deployment serves in")
    p.add_argument("--threads", type=int, default=1, help="torch threads, as a worker would use")
    p.add_argument("--kv-memory-gib", type=float, default=1.0)
    p.add_argument("--transfer-ms", type=float, default=4.0, help="KV transfer time per request (bench.transfer)")
    p.add_argument("--quick", action="store_true", help="fewer points (about 20 s for SmolLM2)")
    p.add_argument("--siblings", type=int, default=0,
                   help="busy worker processes beside the measurement: the deployment's other workers on this "
                        "machine (a worker of 2 on 2 cores: 1), whose share of cores, caches and memory bandwidth "
                        "an isolated profile does not see")
    p.add_argument("--out", default="profile.json")
    p.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    def say(msg: str) -> None:
        print(f"pdserve profile: {msg}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    say(f"measuring {args.model} ({args.dtype}, {args.threads} thread(s)){' quickly' if args.quick else ''}")
    profile = measure(args.model, args.dtype, args.threads, QUICK if args.quick else FULL, args.kv_memory_gib,
                      say=say, siblings=args.siblings)
    profile.transfer_s = args.transfer_ms / 1e3
    profile.save(args.out)
    pre, dec = profile.fit_error()
    say(f"fit: prefill {_coefs(profile.prefill_coef)} (mean error {pre:.0%}), "
        f"decode {_coefs(profile.decode_coef)} (mean error {dec:.0%})")
    say(f"wrote {args.out} in {time.monotonic() - t0:.0f}s")
    return 0


def _coefs(c: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in c) + "]"
