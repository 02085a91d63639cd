"""What the gateway knows of its workers: deep health rounds (the router skips workers that
fail them) and Stats (KV headroom for routing, the prefix cache's events for the router's
prefix index, measured capacity for admission, gauges for /metrics). One round at a time: callers that come while one runs share its result, so a
flood of /ready or /metrics costs the workers one round, not one each."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from gateway.admission import Admission
from gateway.backend import Backend
from gateway.metrics import WorkerGauges
from gateway.routing.router import Router
from rpc import pdserve_pb2 as pb
from rpc.convert import kv_events_from_pb

log = logging.getLogger(__name__)

# A resync's pages asked for back to back in one round (a page is 65,536 blocks): past this
# the rest follows in the next rounds.
MAX_RESYNC_PAGES = 64


class Readiness:
    def __init__(self, router: Router, backend: Backend, admission: Admission, interval_s: float):
        self.router, self.backend, self.admission, self.interval_s = router, backend, admission, interval_s
        self.gauges = WorkerGauges()
        self.checked_at, self.ok = -math.inf, False  # never checked: stale
        self._in_flight: dict[str, asyncio.Task] = {}
        self._members = 0  # bumped by each membership change: a round answers for the members it checked

    def stale(self) -> None:
        """The membership changed: the next /ready checks the new members. A round still
        running over the old ones is no longer shared, and its verdict is dropped."""
        self.checked_at = -math.inf
        self._members += 1
        self._in_flight.pop("health", None)

    async def ready(self) -> bool:
        """Ready: some decode worker (and, with a prefill pool, some prefill worker) passes
        deep health, as of at most one interval ago."""
        for _ in range(2):  # a second round only if the members changed during the first
            if time.monotonic() - self.checked_at <= self.interval_s:
                break
            await self.shared("health", self._refresh)
        return self.ok

    async def observe(self) -> None:
        """Stats only (counters, no forward pass): routing's headroom and the gauges."""
        await self.shared("stats", self._observe_round)

    async def worker_metrics(self) -> list[pb.MetricsResponse]:
        """Every answering worker's registry; concurrent scrapes share one round of calls."""
        return await self.shared("metrics", self.backend.all_metrics)

    async def loop(self) -> None:
        """Stats at once, then a health round every interval. The Stats come at start, not
        an interval later: with several gateway processes on a port, a /ready reaches only
        one of them, and each must know its workers' sizes (the tenants' default limit) and
        headroom before the first requests the kernel hands it."""
        try:
            await self.observe()
        except Exception:
            log.exception("first stats round failed")
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.shared("health", self._refresh)
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health check round failed")

    async def shared(self, name: str, fn):
        """`fn()`'s result; callers that come while a run named `name` is in flight share it
        (a caller that leaves does not cancel it for the others)."""
        task = self._in_flight.get(name)
        if task is None or task.done():
            task = self._in_flight[name] = asyncio.create_task(fn())
        return await asyncio.shield(task)

    async def _refresh(self) -> bool:
        router, backend, members = self.router, self.backend, self._members
        decode, prefill = list(router.decode), list(router.prefill)  # membership may change meanwhile
        decode_h = await asyncio.gather(*(backend.health(w.address, deep=True) for w in decode))
        prefill_h = await asyncio.gather(*(backend.health(w.address, deep=True) for w in prefill))
        await self._observe_round()
        for w, h in zip(decode + prefill, decode_h + prefill_h):
            if w.healthy != h.ok:
                log.info("worker %s is %s", w.address, "healthy again" if h.ok else f"failing deep health: {h.detail}")
            w.healthy = h.ok
            if h.longest_step_s > 0:
                w.longest_step_s = h.longest_step_s
        ok = any(h.ok for h in decode_h) and (not prefill or any(h.ok for h in prefill_h))
        if members == self._members:  # else it checked workers the gateway no longer has
            self.ok, self.checked_at = ok, time.monotonic()
        return ok

    async def _observe_round(self) -> dict[str, pb.StatsResponse | None]:
        """A Stats round observed: routing's headroom, the gauges, the prefix index (the rest
        of any resync too); returns the answers."""
        asked, stats = await self._stats_round()
        self._observe_stats(asked, stats)
        await self._rest_of_resyncs(stats)
        return stats

    async def _stats_round(self) -> tuple[float, dict[str, pb.StatsResponse | None]]:
        """Every worker's Stats, and when they were asked for (what they can have seen)."""
        asked = time.monotonic()
        requests = {w.address: self._stats_request(w.address) for w in self.router.decode + self.router.prefill}
        return asked, await self.backend.all_stats(requests)

    def _stats_request(self, address: str) -> pb.StatsRequest:
        """Stats with the prefix-cache events after this gateway's cursor for the worker."""
        cursor = self.router.index.cursor(address)
        return (pb.StatsRequest(kv_events=True) if cursor is None else
                pb.StatsRequest(kv_events=True, kv_events_of=cursor[0], kv_events_after=cursor[1],
                                kv_events_resync_after=cursor[2]))

    async def _rest_of_resyncs(self, stats: dict[str, pb.StatsResponse | None]) -> None:
        """A worker whose answer was a resync's page with more to come is asked again at once
        for each next page (worker/kv_event_log.py), so its whole set arrives within the round,
        each answer a page's size, however many blocks it caches."""
        index = self.router.index
        for address, s in stats.items():
            for _ in range(MAX_RESYNC_PAGES):
                if s is None or not s.HasField("kv_events") or not s.kv_events.more:
                    break
                s = await self.backend.stats(address, self._stats_request(address))
                if s is not None and s.worker and s.HasField("kv_events"):
                    index.apply(address, s.worker, kv_events_from_pb(s.kv_events))

    def _observe_stats(self, asked: float, stats: dict[str, pb.StatsResponse | None]) -> None:
        router = self.router
        for w in router.decode + router.prefill:
            s = stats.get(w.address)
            if s is not None and s.worker:
                w.name = s.worker
            if s is not None and s.block_size:
                w.observe(s.free_blocks, s.total_blocks, s.block_size, s.waiting_tokens, asked_at=asked,
                          max_sequences=s.max_num_seqs + s.max_waiting)
                router.block_size = s.block_size  # the prompt's block hashes must be the workers' blocks
            if s is not None and s.worker and s.HasField("kv_events"):
                router.index.apply(w.address, s.worker, kv_events_from_pb(s.kv_events))
        # admission's prior: the prompt tokens per second the prefilling pool measured itself at
        prefilling = router.prefill or router.decode
        self.admission.observe_capacity(sum(s.prefill_tokens_per_s for w in prefilling
                                            if w.healthy and (s := stats.get(w.address)) is not None))
        self.gauges.export(stats, {a: router.index.size(a) for a in stats},
                           {w.address: w.breaker.open for w in router.decode})
