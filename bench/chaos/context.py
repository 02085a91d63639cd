"""What every scenario gets (`Chaos`), and `settle`: how every scenario ends."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

from bench.chaos.deployment import Deployment
from bench.chaos.report import Outcome, Record, Result
from bench.chaos.sizes import Sizes


@dataclass
class Chaos:
    """What every scenario gets: the deployment, the sizes and a seeded random source."""

    dep: Deployment
    sizes: Sizes
    rng: random.Random


async def settle(ctx: Chaos, res: Result, records: list[Record], fault_at: float = 0.0,
                 recovery: asyncio.Task | None = None, replacing: asyncio.Task | None = None) -> Result:
    """After a scenario: its records counted, recovery and replacement times, then every
    worker back, idle and checked for leaked KV blocks."""
    res.count(records)
    res.figures["errors"] = dict(Counter(f"{r.status} {r.error[:90]}" for r in records if r.error).most_common(6))
    if recovery is not None:
        res.recovery_s, probes = await recovery
        res.hung += sum(p.outcome is Outcome.HUNG for p in probes)
        res.figures["recovery_probes"] = dict(Counter(p.outcome.value for p in probes))
    if replacing is not None:
        seen = await replacing
        res.replaced_s = None if seen is None else seen - fault_at
        res.notes.append("not replaced" if seen is None else f"replaced after {res.replaced_s:.1f}s")
    workers = await ctx.dep.all_ready()
    res.leaked_blocks, res.figures["held"] = await ctx.dep.idle_leaks(workers)
    series = await asyncio.to_thread(ctx.dep.metric_workers)
    res.figures["metrics_worker_series"] = len(series)
    if len(series) > len(workers):
        res.notes.append(f"/metrics keeps {len(series) - len(workers)} series of gone workers")
    return res

