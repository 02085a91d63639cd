"""The engine loop's Prometheus metrics (prefix pdserve_engine_), in the worker process's
registry beside the KV transfer's (transfer/metrics.py); the `Metrics` RPC hands the whole
registry to the gateway, whose /metrics labels each worker's series with `worker` and `role`.

A step's kind: `decode` (every chunk one token), `prefill` (no decode), `mixed` (both)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from engine.llm_engine import StepStats
from engine.scheduler import SchedulerOutput

STEP_SECONDS = Histogram(
    "pdserve_engine_step_seconds", "Engine step duration (schedule excluded) by kind", ["kind"],
    buckets=(0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STEP_TOKENS = Histogram("pdserve_engine_step_tokens", "Tokens computed per engine step by kind", ["kind"],
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
STEP_SEQUENCES = Histogram("pdserve_engine_step_sequences", "Sequences per engine step by kind", ["kind"],
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
PREEMPTIONS = Counter("pdserve_engine_preemptions", "Sequences preempted (recomputed later) for KV blocks")


def step_kind(out: SchedulerOutput) -> str:
    decodes = sum(1 for c in out.chunks if c.num_new == 1)
    return "decode" if decodes == len(out.chunks) else "prefill" if decodes == 0 else "mixed"


def observe_step(out: SchedulerOutput, stats: StepStats | None) -> None:
    """One scheduled step: its preemptions, and if it ran, the engine's own size and duration."""
    if out.preempted:
        PREEMPTIONS.inc(len(out.preempted))
    if stats is None:
        return
    kind = step_kind(out)
    STEP_SECONDS.labels(kind).observe(stats.seconds)
    STEP_TOKENS.labels(kind).observe(stats.num_tokens)
    STEP_SEQUENCES.labels(kind).observe(stats.num_seqs)
