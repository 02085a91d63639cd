"""The KV-transfer fault scenarios: a slow link, a stuck one and a failing one, injected
into the prefill worker's pushes through PDSERVE_FAULT_TRANSFER_FILE (transfer/faults.py)
while the deployment runs. The policy under test (docs/workers.md): a failed push moves the
request to the next prefill worker, then to local prefill; a stuck one is aborted at the
decode worker's --prefill-timeout and prefilled locally. Every request completes; a broken
link costs latency, never a request or a block. With one of two prefill workers failing
every push, its requests complete remotely on the other."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.chaos.client import client, completion, recover, send
from bench.chaos.context import Chaos, settle
from bench.chaos.report import Outcome, Record, Result
from bench.serving import percentile
from gateway.routing.router import Router


async def _remote_tokens(ctx: Chaos) -> int:
    """Prompt tokens whose KV the decode workers have received from a prefill worker so far."""
    workers = [w for w in await asyncio.to_thread(ctx.dep.workers) if w["role"] == "decode"]
    stats = await asyncio.gather(*(asyncio.to_thread(ctx.dep.stats, w) for w in workers))
    return sum(s.kv_blocks_transferred * s.block_size for s in stats if s is not None)


async def _batch(ctx: Chaos, bodies: list[dict] | None = None) -> tuple[list[Record], int]:
    """The scenario's requests (fresh long prompts unless given), all at once; and how many
    of them were prefilled remotely."""
    n, prompt = ctx.sizes.transfer_requests, ctx.sizes.long_prompt
    bodies = bodies or [completion(prompt, 4, ctx.rng) for _ in range(n)]
    before = await _remote_tokens(ctx)
    async with client() as http:
        records = await asyncio.gather(*(send(http, ctx.dep.url, body) for body in bodies))
    return records, round((await _remote_tokens(ctx) - before) / prompt)  # whole blocks: a slight over-count


async def _with_fault(ctx: Chaos, res: Result, fault: str, bodies: list[dict] | None = None) -> Result:
    """The batch under `fault`, then the fault lifted: every request must have completed, and
    a fresh request must be served (and prefilled remotely) again."""
    ctx.dep.set_transfer_fault(fault)
    fault_at = time.monotonic()
    try:
        records, remote = await _batch(ctx, bodies)
    finally:
        ctx.dep.set_transfer_fault(None)
    lifted = await _remote_tokens(ctx)
    async with client() as http:
        recovery = asyncio.create_task(recover(http, ctx.dep.url, time.monotonic(), ctx.rng,
                                               prompt_len=ctx.sizes.long_prompt))
        res = await settle(ctx, res, records, fault_at, recovery)
    if await _remote_tokens(ctx) == lifted:
        res.broken.append("once the fault was lifted, no request was prefilled remotely")
    lost = sum(r.outcome is not Outcome.COMPLETED for r in records)
    if lost:
        res.broken.append(f"{lost} of {len(records)} requests not completed (the policy falls back to local prefill)")
    ttft = percentile([r.ttft_s for r in records if r.ttft_s is not None], 50)
    res.figures.update(fault=fault, requests=len(records), prefilled_remotely=remote, ttft_p50_s=ttft)
    res.notes.append(f"`{fault}`: {remote} of {len(records)} prefilled remotely, the rest locally; TTFT p50 "
                     + ("-" if ttft is None else f"{ttft:.2f}s"))
    return res


async def transfer_slow(ctx: Chaos) -> Result:
    """Every KV write posted a second late: requests complete, later (TTFT beside a batch
    without the fault, run first)."""
    baseline, _ = await _batch(ctx)
    res = await _with_fault(ctx, Result("transfer-slow", fault=True), "delay_s=1")
    before = percentile([r.ttft_s for r in baseline if r.ttft_s is not None], 50)
    res.figures["ttft_p50_without_fault_s"] = before
    if before is not None:
        res.notes.append(f"{before:.2f}s without the fault")
    return res


async def transfer_stuck(ctx: Chaos) -> Result:
    """KV writes never posted: each request is aborted at the decode worker's prefill timeout
    and prefilled locally; none may be prefilled remotely."""
    res = await _with_fault(ctx, Result("transfer-stuck", fault=True), "delay_s=inf")
    if res.figures["prefilled_remotely"]:
        res.broken.append(f"{res.figures['prefilled_remotely']} prefilled remotely through a stuck link")
    res.notes.append(f"prefill timeout {ctx.sizes.prefill_timeout_s:.0f}s")
    return res


async def transfer_error(ctx: Chaos) -> Result:
    """Half of the KV writes fail as a broken link would: those requests are prefilled locally."""
    return await _with_fault(ctx, Result("transfer-error", fault=True), "error_rate=0.5")


def _failed_attempts_on(ctx: Chaos, address: str, what: str = "prefill on {address} failed") -> int:
    """Remote prefill attempts on `address` that the decode workers logged as failed (or
    another line of theirs about it, `what`)."""
    logs = [w["log"] for w in ctx.dep.workers() if w["role"] == "decode" and w.get("log")]
    return sum(Path(log).read_text(errors="replace").count(what.format(address=address)) for log in logs)


async def transfer_error_first(ctx: Chaos) -> Result:
    """Every KV write of the first prefill worker fails: each of its requests moves on to
    the second, where no push fails, and completes; every block back. One whose second
    attempt outlasts the remote-prefill budget (the quick config's fixed `--prefill-timeout`,
    which a busy host's queues can pass) is prefilled locally, as designed: counted, not a problem."""
    res = Result("transfer-error-first", fault=True)
    prefill = sorted((w for w in await asyncio.to_thread(ctx.dep.workers) if w["role"] == "prefill"),
                     key=lambda w: int(w["worker_id"]))
    if len(prefill) < 2:
        res.broken.append(f"needs two prefill workers, the deployment has {len(prefill)}")
        return res
    first, second = prefill[0], prefill[1]
    # Prompts the gateway's router sends to the first worker first (its rendezvous ranking;
    # the scenarios' default tenant shares its prefix cache, salt ""): each must fail there and move on.
    ranking = Router([], [first["address"], second["address"]])
    bodies: list[dict] = []
    while len(bodies) < ctx.sizes.transfer_requests:
        body = completion(ctx.sizes.long_prompt, 4, ctx.rng)
        if ranking.rank_prefill(body["prompt"])[0] == first["address"]:
            bodies.append(body)
    moved, pushes = "prefill on {address} (attempt 2)", "prefill on {address} failed: KV push"
    failed_before = await asyncio.to_thread(_failed_attempts_on, ctx, first["address"])
    moved_before = await asyncio.to_thread(_failed_attempts_on, ctx, second["address"], moved)
    pushes_before = await asyncio.to_thread(_failed_attempts_on, ctx, second["address"], pushes)
    res = await _with_fault(ctx, res, f"error_rate=1 only=prefill-{first['worker_id']}", bodies)
    failed = await asyncio.to_thread(_failed_attempts_on, ctx, first["address"]) - failed_before
    res.figures["moved_to_second"] = await asyncio.to_thread(_failed_attempts_on, ctx, second["address"],
                                                             moved) - moved_before
    res.figures["pushes_failed_on_second"] = await asyncio.to_thread(_failed_attempts_on, ctx, second["address"],
                                                                     pushes) - pushes_before
    res.figures["failed_on_first"] = failed
    res.notes.append(f"{failed} attempts failed on prefill worker {first['worker_id']}")
    if failed == 0:
        res.broken.append("no attempt reached the failing prefill worker: the scenario tested nothing")
    if res.figures["moved_to_second"] < res.figures["requests"]:
        res.broken.append(f"only {res.figures['moved_to_second']} of {res.figures['requests']} moved on to the "
                          "second prefill worker")
    if res.figures["pushes_failed_on_second"]:
        res.broken.append(f"{res.figures['pushes_failed_on_second']} pushes failed on the second prefill worker, "
                          "which the fault does not name")
    return res
