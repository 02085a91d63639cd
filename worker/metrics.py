"""The engine loop's Prometheus metrics (prefix pdserve_engine_), in the worker process's
registry beside the KV transfer's (transfer/metrics.py); the `Metrics` RPC hands the whole
registry to the gateway, whose /metrics labels each worker's series with `worker` and `role`.

A step's kind: `decode` (every chunk one token), `prefill` (no decode), `mixed` (both)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from common import envs
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
QUEUE_SECONDS = Histogram(
    "pdserve_engine_queue_seconds", "From a request's arrival at the worker to its first step (blocks reserved or "
    "first chunk run)", buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
PROMPT_TOKENS = Counter("pdserve_engine_prompt_tokens", "Prompt tokens of the requests this worker scheduled")
PREFIX_HIT_TOKENS = Counter("pdserve_engine_prefix_cache_hit_tokens",
                            "Prompt tokens served by this worker's prefix cache (not computed, not transferred)")
# Where the prefix cache's hits came from before they were hits: blocks brought into the pool
# instead of computed, from the worker's disk tier (engine/disk_tier.py) or from a sibling
# worker's pool over NIXL (worker/prefix_fetch.py). Tokens, a block's worth each.
PREFIX_TIER_TOKENS = Counter("pdserve_engine_prefix_tier_tokens",
                             "Prompt tokens brought into this worker's KV pool from a lower tier instead of "
                             "computed, by tier: disk or sibling", ["tier"])
PREFIX_FETCHES = Counter("pdserve_prefix_fetches", "Prompt prefixes this worker was offered from another worker's "
                         "prefix cache (a decode worker's prefix source, a prefill worker's asking decode worker), "
                         "by outcome: fetched (every block asked for came over), partial (the holder had evicted "
                         "some), evicted (it had evicted them all), failed, skipped_cost (predicted slower than "
                         "computing them), skipped_room (no free blocks for them now)", ["outcome"])
for _outcome in ("fetched", "partial", "evicted", "failed", "skipped_cost", "skipped_room"):
    PREFIX_FETCHES.labels(_outcome)


_STEP_METRICS = envs.step_metrics_enabled()  # read once: this runs every step


def observe_first_step(prompt_tokens: int, cached_tokens: int, queue_s: float) -> None:
    """A request's first step on this worker: how long it queued, how much of its prompt was cached."""
    QUEUE_SECONDS.observe(queue_s)
    PROMPT_TOKENS.inc(prompt_tokens)
    PREFIX_HIT_TOKENS.inc(cached_tokens)


def step_kind(out: SchedulerOutput) -> str:
    decodes = sum(1 for c in out.chunks if c.num_new == 1)
    return "decode" if decodes == len(out.chunks) else "prefill" if decodes == 0 else "mixed"


def observe_step(out: SchedulerOutput, stats: StepStats | None) -> None:
    """One scheduled step: its preemptions, and if it ran, the engine's own size and duration."""
    if out.preempted:
        PREEMPTIONS.inc(len(out.preempted))
    if stats is None or not _STEP_METRICS:
        return
    kind = step_kind(out)
    STEP_SECONDS.labels(kind).observe(stats.seconds)
    STEP_TOKENS.labels(kind).observe(stats.num_tokens)
    STEP_SEQUENCES.labels(kind).observe(stats.num_seqs)
