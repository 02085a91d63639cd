"""The load scenarios: a cancellation storm, and an open loop at 5x capacity followed by a
retry storm (clients resending every 429 at once)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from bench.chaos.client import client, completion, recover, send
from bench.chaos.context import Chaos, settle
from bench.chaos.report import Outcome, Record, Result
from bench.chaos.sizes import MAX_TTFT_S
from bench.serving import percentile

PROBE_CLIENTS = 32
MIN_PROBE_SERVED = 4  # requests served in the probe's second half for its rate to mean anything

LEAVE_KINDS = ("after send", "after first token", "mid-stream", "non-stream after send")


async def storm(ctx: Chaos) -> Result:
    """A cancellation storm: 30% of the requests are left by their client at a random point
    (queued, in prefill, in transfer, mid-decode); nothing may leak or hang."""
    res, dep, s, rng = Result("cancel-storm", no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    gate = asyncio.Semaphore(s.storm_concurrency)
    left: Counter[str] = Counter()

    async def one(http: httpx.AsyncClient, body: dict, kind: str | None, delay: float) -> Record:
        async with gate:
            if kind == "after send":
                return await send(http, dep.url, body, leave_after_s=delay)
            if kind == "non-stream after send":
                return await send(http, dep.url, {**body, "stream": False}, leave_after_s=delay)
            if kind == "after first token":
                return await send(http, dep.url, body, leave_after_chunks=1)
            if kind == "mid-stream":
                chunks = rng.randint(2, max(2, body["max_tokens"] // 2))
                return await send(http, dep.url, body, leave_after_chunks=chunks)
            return await send(http, dep.url, body)

    plans = []
    for _ in range(s.storm):
        kind = rng.choice(LEAVE_KINDS) if rng.random() < 0.3 else None
        left[kind or "stayed"] += 1
        body = completion(rng.randint(8, s.storm_prompt), rng.randint(2, s.storm_output), rng)
        plans.append((body, kind, rng.uniform(0.0, 1.5)))
    t0 = time.monotonic()
    async with client() as http:
        records = await asyncio.gather(*(one(http, *plan) for plan in plans))
    res.figures.update(leave_plan=dict(left), seconds=round(time.monotonic() - t0, 1))
    rejected = sum(r.status == 429 for r in records)
    res.notes.append(f"{len(records)} requests in {res.figures['seconds']}s, "
                     f"{sum(r.outcome is Outcome.CANCELLED for r in records)} left by the client"
                     + (f", {rejected} shed (429)" if rejected else ""))
    return await settle(ctx, res, records)


async def overload(ctx: Chaos) -> Result:
    """Open loop at 5x the capacity a closed-loop probe measured: the admitted requests keep
    the TTFT bound, the rest get a fast 429, memory stays bounded, no worker crashes."""
    res, dep, s, rng = Result("overload-5x", fault=True, no_5xx=True), ctx.dep, ctx.sizes, ctx.rng
    rss_before = await asyncio.to_thread(dep.rss_mb)
    async with client() as http:
        async def closed_loop(t0: float, probe_s: float, probe: list) -> None:
            """Enough clients to saturate it; a 429 backs off a little."""
            while time.monotonic() - t0 < probe_s:
                probe.append(rec := await send(http, dep.url, completion(64, 16, rng)))
                if rec.status == 429:
                    await asyncio.sleep(0.2)

        # The served rate once the pipeline is full: in a closed loop, requests are sent as
        # fast as they are served, so those sent (and served) in the second half, over it.
        # A window too short for this host to serve MIN_PROBE_SERVED in its second half
        # measures nothing: it doubles (up to 8x), so a slow host gets the time it needs.
        probe_s = s.probe_s
        while True:
            t0, probe = time.monotonic(), []
            await asyncio.gather(*(closed_loop(t0, probe_s, probe) for _ in range(PROBE_CLIENTS)))
            half = t0 + probe_s / 2
            served = sum(r.outcome is Outcome.COMPLETED and r.sent_at >= half for r in probe)
            if served >= MIN_PROBE_SERVED or probe_s >= 8 * s.probe_s:
                break
            probe_s *= 2
        capacity = served / (probe_s / 2)
        probe_shed = sum(r.status == 429 for r in probe)
        rate = 5 * max(capacity, 0.2)
        arrivals, at = [], 0.0
        while at < s.overload_s:
            at += rng.expovariate(rate)
            arrivals.append(at)
        start = time.monotonic()

        async def scheduled(at: float) -> Record:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return await send(http, dep.url, completion(64, 16, rng))

        records = await asyncio.gather(*(scheduled(a) for a in arrivals))
        storm_figures = await _retry_storm(http, dep.url, s.retry_storm_s, capacity, rng)
        # Once the load is gone, the overload's own request shape is admitted again at once,
        # and so is a long prompt: an idle system has no reason to shed.
        res.recovery_s, _ = await recover(http, dep.url, time.monotonic(), rng, 30.0, prompt_len=64)
        idle = await send(http, dep.url, completion(s.long_prompt, 2, rng, stream=False))
        if idle.outcome is not Outcome.COMPLETED:
            res.broken.append(f"once idle, a {s.long_prompt}-token prompt got {idle.status}: {idle.error}")
    admitted = [r.ttft_s for r in records if r.status == 200 and r.ttft_s is not None]
    res.figures["per_second"] = _per_second(records, start)
    shed = [r for r in records if r.status == 429]
    ttft_p90, shed_p99 = percentile(admitted, 90), percentile([r.answered_s for r in shed], 99)
    res = await settle(ctx, res, records)
    if ttft_p90 is not None and ttft_p90 > MAX_TTFT_S:
        res.slow.append(f"admitted TTFT p90 {ttft_p90:.2f}s is over the {MAX_TTFT_S:.0f}s bound")
    rss_after = await asyncio.to_thread(dep.rss_mb)
    res.figures.update(capacity_rps=round(capacity, 2), probe_s=probe_s, probe_429=probe_shed, offered_rps=round(rate, 2),
                       ttft_p90_s=ttft_p90,
                       ttft_bound_s=MAX_TTFT_S, rejected=len(shed), time_to_429_p99_s=shed_p99,
                       rejected_by=dict(Counter(r.code for r in shed)), rss_mb_before=rss_before,
                       rss_mb_after=rss_after, retry_storm=storm_figures)
    if storm_figures["other_statuses"]:
        res.broken.append(f"the retry storm got {storm_figures['other_statuses']} (only 200 and 429 are answers)")
    if storm_figures["served_over_capacity"] < 0.5:
        res.slow.append(f"under the retry storm the served rate fell to {storm_figures['served_over_capacity']:.2f} "
                        "of the measured capacity")
    res.notes.append(f"capacity {capacity:.1f} req/s ({probe_shed} x 429 while probing), offered {rate:.1f}; "
                     "admitted TTFT p90 "
                     f"{_s(ttft_p90)} (bound {MAX_TTFT_S:.0f}s); {len(shed)} x 429, p99 {_s(shed_p99)}; "
                     f"RSS MB {_rss_change(rss_before, rss_after)}")
    return res


STORM_CLIENTS = 4 * PROBE_CLIENTS  # each resends its request the moment it gets a 429


async def _retry_storm(http: httpx.AsyncClient, url: str, seconds: float, capacity: float, rng) -> dict:
    """STORM_CLIENTS clients that resend every 429 at once, ignoring its Retry-After (one
    client team's aggressive retries), for `seconds`: the requests served per second against
    the capacity the closed loop measured (the backend's rate should hold: the gateway sheds
    the excess with cheap 429s and adds no retries of its own), the 429s and the Retry-After
    values they carried (the gateway's measured queue drain), and the gateway's retry-budget
    counters over the storm (pdserve_retry_budget_total: what it spent and refused itself)."""
    before = await _budget_counts(http, url)
    statuses: Counter[int] = Counter()
    retry_after: list[int] = []
    served = 0
    t0 = time.monotonic()

    async def aggressive() -> None:
        nonlocal served
        while time.monotonic() - t0 < seconds:
            body = completion(64, 4, rng, stream=False)
            try:
                r = await http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError:
                statuses[0] += 1
                continue
            statuses[r.status_code] += 1
            if r.status_code == 200:
                served += 1
            elif r.status_code == 429 and r.headers.get("retry-after", "").isdigit():
                retry_after.append(int(r.headers["retry-after"]))

    await asyncio.gather(*(aggressive() for _ in range(STORM_CLIENTS)))
    took = time.monotonic() - t0
    after = await _budget_counts(http, url)
    rate = served / took
    return {"seconds": round(took, 1), "clients": STORM_CLIENTS, "served": served,
            "served_rps": round(rate, 2), "served_over_capacity": round(rate / max(capacity, 1e-9), 2),
            "status_429": statuses[429], "other_statuses": {k: v for k, v in statuses.items() if k not in (200, 429)},
            "retry_after_s": [min(retry_after), max(retry_after)] if retry_after else None,
            "retry_budget": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


async def _budget_counts(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """pdserve_retry_budget_total by "kind/outcome", as the gateway's /metrics says now."""
    text = (await http.get(f"{url}/metrics")).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdserve_retry_budget_total{"):
            labels, value = line.rsplit(" ", 1)
            kind = labels.split('kind="')[1].split('"')[0]
            outcome = labels.split('outcome="')[1].split('"')[0]
            counts[f"{kind}/{outcome}"] = float(value)
    return counts


def _per_second(records: list[Record], start: float) -> list[dict]:
    """The overload second by second: requests sent, admitted, shed, and the admitted ones' TTFT p90."""
    out: list[dict] = []
    for r in records:
        second = int(r.sent_at - start)
        while len(out) <= second:
            out.append({"sent": 0, "admitted": 0, "shed": 0, "ttfts": []})
        row = out[second]
        row["sent"] += 1
        row["admitted"] += r.status == 200
        row["shed"] += r.status == 429
        if r.status == 200 and r.ttft_s is not None:
            row["ttfts"].append(r.ttft_s)
    for row in out:
        ttfts = row.pop("ttfts")
        row["ttft_p90_s"] = percentile(ttfts, 90)
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def _rss_change(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {before[k]:.0f}->{after[k]:.0f}" for k in before if k in after)

