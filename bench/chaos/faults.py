"""The fault scenarios: kill -9 of the prefill worker, of a decode worker, of one rank of a
tensor-parallel decode worker, of the gateway, and a wedged decode worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import psutil

from bench.chaos.client import client, completion, recover, send, until
from bench.chaos.context import Chaos, settle
from bench.chaos.report import Outcome, Record, Result
from bench.chaos.sizes import RECOVERY_TIMEOUT_S
from worker.exit_codes import RANK_LOST, describe

GROUP_END_S = 30.0  # after the replacement, how long the old group's processes may take to end


async def kill_prefill(ctx: Chaos) -> Result:
    """kill -9 of the prefill worker while long prompts' KV is being pushed to the decode
    workers: they must prefill elsewhere (locally) or fail cleanly."""
    res, dep, n = Result("kill-prefill", fault=True), ctx.dep, ctx.sizes.streams
    victim = await asyncio.to_thread(dep.worker, "prefill")
    before = await asyncio.to_thread(dep.stats, victim)
    offset = len(dep.log_text())

    async def pushing() -> bool:  # busy, and some KV already moved: transfers are in flight
        s = await asyncio.to_thread(dep.stats, victim)
        return s is not None and s.kv_blocks_transferred > before.kv_blocks_transferred and \
            (s.running_requests + s.waiting_requests) > 0

    async with client() as http:
        tasks = [asyncio.create_task(send(http, dep.url, completion(ctx.sizes.long_prompt, 8, ctx.rng)))
                 for _ in range(n)]

        async def pushing_or_over() -> bool:
            return all(t.done() for t in tasks) or await pushing()

        if not await until(pushing_or_over, 60) or all(t.done() for t in tasks):
            res.notes.append("no transfer seen before the kill")
        fault_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        replacing = asyncio.create_task(dep.logged(r"prefill worker 0: incarnation \d+ ready", offset,
                                                   RECOVERY_TIMEOUT_S))
        records = await asyncio.gather(*tasks)
        return await settle(ctx, res, records, fault_at, recovery, replacing)


async def _streams_then_kill(ctx: Chaos, res: Result, kill: Callable[[], None], replaced: str) -> Result:
    """Long streams on both decode workers; once every one has its first token, `kill()`."""
    dep, n = ctx.dep, ctx.sizes.streams
    streaming, every = [0], asyncio.Event()

    def on_text() -> None:
        streaming[0] += 1
        if streaming[0] >= n:
            every.set()

    async def stream() -> Record:
        rec = await send(http, dep.url, completion(32, ctx.sizes.stream_tokens, ctx.rng), on_text=on_text)
        if rec.ttft_s is None:  # ended without text (refused): no need to wait for it
            on_text()
        return rec

    offset = len(dep.log_text())
    async with client() as http:
        tasks = [asyncio.create_task(stream()) for _ in range(n)]
        await every.wait()
        if any(t.done() for t in tasks):
            res.notes.append(f"{sum(t.done() for t in tasks)} streams ended before the kill")
        fault_at = time.monotonic()
        kill()
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        replacing = asyncio.create_task(dep.logged(replaced, offset, RECOVERY_TIMEOUT_S))
        records = await asyncio.gather(*tasks)
        return await settle(ctx, res, records, fault_at, recovery, replacing)


async def kill_decode(ctx: Chaos) -> Result:
    """kill -9 of a decode worker mid-stream: the gateway replays each of its streams on the
    other decode worker (prompt + the tokens streamed so far) and its clients read on, so
    none fails; new requests go to the other decode worker."""
    victim = await asyncio.to_thread(ctx.dep.worker, "decode", "0")
    res = Result("kill-decode", fault=True)
    before = await asyncio.to_thread(ctx.dep.replays)
    res = await _streams_then_kill(ctx, res, lambda: os.kill(victim["pid"], signal.SIGKILL),
                                   r"decode worker 0: incarnation \d+ ready")
    res.figures["replayed"] = int(await asyncio.to_thread(ctx.dep.replays) - before)
    if res.failed_cleanly:
        res.broken.append(f"{res.failed_cleanly} streams failed: each should have been replayed on the other worker")
    res.notes.append(f"{res.figures['replayed']} streams replayed")
    return res


async def kill_decode_rank(ctx: Chaos) -> Result:
    """kill -9 of one follower rank of a tensor-parallel decode worker mid-stream: the worker
    exits (code 70) and the controller replaces the whole group; its streams move to another
    decode worker if there is one, else end with an error event; every process of the old
    group ends; a fresh request is served once the new group is ready."""
    dep, res = ctx.dep, Result("kill-decode-rank", fault=True)
    victim = await asyncio.to_thread(dep.worker, "decode", "0")
    group = await asyncio.to_thread(dep.group, victim)
    res.figures["ranks"] = len(group)
    if len(group) < 2:
        res.broken.append(f"decode worker 0 has {len(group)} rank: no follower to kill")
        return res
    old = [group[0], *await asyncio.to_thread(group[0].children, True)]  # ranks, resource tracker...
    offset, before = len(dep.log_text()), await asyncio.to_thread(dep.replays)
    replaced = r"decode worker 0: incarnation \d+ ready"
    res = await _streams_then_kill(ctx, res, group[-1].kill, replaced)  # a follower: not rank 0's process
    res.figures["replayed"] = int(await asyncio.to_thread(dep.replays) - before)
    if res.replaced_s is None:
        res.broken.append(f"the group was not replaced within {RECOVERY_TIMEOUT_S:.0f}s")
    if f"decode worker 0: its process exited ({describe(RANK_LOST)})" not in dep.log_text()[offset:]:
        res.broken.append("the controller did not report the worker's exit for a lost rank")
    _, alive = await asyncio.to_thread(psutil.wait_procs, old, GROUP_END_S)
    res.figures["old_group_left"] = [p.pid for p in alive]
    if alive:
        res.broken.append(f"{len(alive)} of the old group's {len(old)} processes still running")
    refused = res.figures.get("recovery_probes", {}).get(Outcome.FAILED_CLEANLY.value, 0)
    res.notes.append(f"{len(group)} ranks ({len(old)} processes), {len(old) - len(alive)} ended; "
                     f"{res.figures['replayed']} streams replayed; {refused} fresh requests refused cleanly "
                     "until the new group served")
    return res


async def kill_gateway(ctx: Chaos) -> Result:
    """kill -9 of the gateway process: its clients see cut connections (never a hang), the
    workers cancel the orphaned streams, the controller has Ray restart the gateway."""
    gateway = await asyncio.to_thread(ctx.dep.gateway)
    res = Result("kill-gateway", fault=True, dropped_ok=True)
    return await _streams_then_kill(ctx, res, gateway.kill, "gateway restarted")


async def wedged_decode(ctx: Chaos) -> Result:
    """A decode worker's engine loop stalls while its gRPC server answers: the gateway's
    deep health routes around it, the controller's replaces it; a steady load runs through."""
    res, dep = Result("wedged-decode", fault=True), ctx.dep
    victim = await asyncio.to_thread(dep.worker, "decode", "1")
    name = (await asyncio.to_thread(dep.stats, victim)).worker
    stop, records = asyncio.Event(), []
    offset = len(dep.log_text())

    async with client() as http:
        async def load() -> None:  # closed loop: the next request when the last one ends
            while not stop.is_set():
                records.append(await send(http, dep.url, completion(32, 16, ctx.rng)))

        loaders = [asyncio.create_task(load()) for _ in range(4)]
        await asyncio.sleep(2.0)
        fault_at = time.monotonic()
        tmp = dep.stall_file.with_suffix(".tmp")  # written whole, then renamed: an empty file wedges every worker
        tmp.write_text(name + "\n")
        tmp.replace(dep.stall_file)
        recovery = asyncio.create_task(recover(http, dep.url, fault_at, ctx.rng))
        detecting = asyncio.create_task(dep.logged(r"decode worker 1: failed deep health", offset, 60.0))
        replaced = await dep.logged(r"decode worker 1: incarnation \d+ ready", offset, RECOVERY_TIMEOUT_S)
        detected = detecting.result() if detecting.done() else None
        detecting.cancel()
        await asyncio.sleep(2.0)  # the load goes on over the new membership
        stop.set()
        await asyncio.gather(*loaders)
        dep.stall_file.unlink(missing_ok=True)
        lost = sum(r.outcome is not Outcome.COMPLETED for r in records)
        if detected is not None:
            res.notes.append(f"failed deep health after {detected - fault_at:.1f}s")
        res.replaced_s = None if replaced is None else replaced - fault_at
        res.notes.append("not replaced" if replaced is None else f"replaced after {res.replaced_s:.1f}s")
        res.notes.append(f"lost {lost} of {len(records)}")
        return await settle(ctx, res, records, fault_at, recovery)

