"""This machine's roofline for one decode step, measured in the same run as the benchmark.

A decode step for B sequences at context C must at least read every weight once and the
KV of all B sequences, and must do the matmul and attention flops:

    bytes = params * dtype_size + 2 * layers * kv_heads * head_dim * dtype_size * C * B
    flops = 2 * params * B + 4 * layers * heads * head_dim * C * B
    roofline = max(bytes / bandwidth, flops / matmul_rate)

`params` counts a tied embedding once (as the LM head; the embedding lookup reads one row
per token). Bandwidth is a large tensor copy (bytes read + bytes written per second);
matmul rates are measured with the model's own dtype, at the decode shape
([B x hidden] x [hidden x ffn]) and at a big, compute-bound shape. `measure_decode` times
pdserve's engine steps while B sequences all decode and sets them against this bound.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deploy.planner.workload import fixed_requests
from engine import LLM, SamplingParams
from engine.config import ModelConfig


def _best_seconds(fn: Callable[[], object], repeats: int, min_time: float) -> float:
    """Best mean time of one call over `repeats` rounds, each at least `min_time` long."""
    fn()  # warm-up (allocation, oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / calls)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s, counting the bytes read and the bytes written."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeats, min_time=0.0)
    return 2 * n / seconds


def measure_matmul(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 3,
                   min_time: float = 0.1) -> float:
    """FLOP/s of `F.linear` ([m x k] activations, [n x k] weight), as nn.Linear runs it."""
    x = torch.randn(m, k).to(dtype)  # [m, k]
    w = torch.randn(n, k).to(dtype)  # [n, k]
    seconds = _best_seconds(lambda: F.linear(x, w), repeats, min_time)
    return 2 * m * k * n / seconds


@dataclass(frozen=True)
class MachineRates:
    """What this machine sustains: copy bandwidth and matmul rates (per decode batch and peak)."""

    bandwidth: float  # bytes/s, read + write
    matmul_peak: float  # FLOP/s at a big shape
    matmul_at_batch: dict[int, float]  # FLOP/s at [B x hidden] x [hidden x ffn]

    @classmethod
    def measure(cls, cfg: ModelConfig, dtype: torch.dtype, batches: list[int],
                copy_mib: int = 256, big_m: int = 1024) -> MachineRates:
        h, f = cfg.hidden_size, cfg.intermediate_size
        return cls(
            bandwidth=measure_bandwidth(copy_mib),
            matmul_peak=measure_matmul(big_m, h, f, dtype),
            matmul_at_batch={b: measure_matmul(b, h, f, dtype) for b in batches},
        )


@dataclass(frozen=True)
class DecodeRoofline:
    """Lower bounds on one decode step of `batch` sequences at mean context `context`."""

    batch: int
    context: float
    bytes_moved: float
    flops: float
    memory_s: float  # bytes / bandwidth
    compute_peak_s: float  # flops / peak matmul rate
    compute_shape_s: float  # flops / matmul rate at this batch's decode shape

    @property
    def seconds(self) -> float:
        """The classic roofline: memory time or peak-rate compute time, whichever is longer."""
        return max(self.memory_s, self.compute_peak_s)

    @property
    def shape_seconds(self) -> float:
        """The roofline with the matmul rate this machine reaches at the decode shape."""
        return max(self.memory_s, self.compute_shape_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_peak_s else "compute"


def decode_roofline(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: float,
                    rates: MachineRates) -> DecodeRoofline:
    """The roofline of one decode step; `context` is the mean tokens attended per sequence."""
    params = cfg.num_parameters()  # a tied embedding is counted once
    size = dtype.itemsize
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size * context * batch
    bytes_moved = params * size + kv_bytes
    flops = 2 * params * batch + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * batch
    shape_rate = rates.matmul_at_batch.get(batch, rates.matmul_peak)
    return DecodeRoofline(
        batch=batch,
        context=context,
        bytes_moved=bytes_moved,
        flops=flops,
        memory_s=bytes_moved / rates.bandwidth,
        compute_peak_s=flops / rates.matmul_peak,
        compute_shape_s=flops / shape_rate,
    )


@dataclass(frozen=True)
class DecodeResult:
    batch: int
    steps: int  # engine steps in which all `batch` sequences decoded (and nothing else ran)
    mean_s: float
    median_s: float
    context: float  # mean tokens attended per sequence over those steps
    roofline: DecodeRoofline


def measure_decode(llm: LLM, cfg: ModelConfig, dtype: torch.dtype, rates: MachineRates, batch: int,
                   prompt_len: int, steps: int, seed: int = 0) -> DecodeResult:
    """Mean engine step time (schedule + execute) over the steps where all `batch` requests decode (no prefill).

    Each request is asked for enough tokens that at least `steps` such steps run after the
    last prefill chunk (the scheduler runs decodes first, then prefill within its budget).
    """
    engine = llm.engine
    budget = engine.config.scheduler.max_num_batched_tokens
    prefill_steps = math.ceil(batch * prompt_len / max(1, budget - batch))
    requests = fixed_requests(llm.tokenizer, batch, prompt_len, prefill_steps + steps + 2, seed)
    rids = [f"decode-{batch}-{i}" for i in range(batch)]
    generated = dict.fromkeys(rids, 0)
    times, contexts = [], []
    try:
        for rid, r in zip(rids, requests):
            engine.add_request(rid, r.prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        while engine.has_unfinished():
            # a sequence with g tokens generated feeds its last one and attends to prompt + g
            context = prompt_len + sum(generated.values()) / batch
            t0 = time.perf_counter()  # the whole step: scheduling too
            result = engine.execute(engine.schedule())
            seconds = time.perf_counter() - t0
            step = result.stats
            if step is not None and step.num_seqs == batch and step.num_tokens == batch:
                times.append(seconds)
                contexts.append(context)
            for d in result.outputs:
                generated[d.request_id] += len(d.token_ids)
    finally:
        for rid in rids:
            engine.abort_request(rid)
    if not times:
        raise RuntimeError(f"no step ran all {batch} sequences decoding; raise the step count")
    context = statistics.fmean(contexts)
    return DecodeResult(batch, len(times), statistics.fmean(times), statistics.median(times), context,
                        decode_roofline(cfg, dtype, batch, context, rates))
