"""/ready answers for the workers the gateway has now: a health round that began before the
membership changed (a deployment's first push named no decode worker yet) answers for the
old members only, never for the new ones."""

from __future__ import annotations

import asyncio

from gateway.admission import Admission
from gateway.readiness import Readiness
from gateway.routing.router import Router
from rpc import pdserve_pb2 as pb


class _Workers:
    """The gateway's view of worker processes, by address: each answers Health as told; the
    first round's answers are held until `release` (a worker slow to answer its first call)."""

    def __init__(self):
        self.release = asyncio.Event()
        self.calls = 0

    async def health(self, address: str, deep: bool, timeout: float = 10.0) -> pb.HealthResponse:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
        return pb.HealthResponse(ok=True)

    async def all_stats(self, requests=None) -> dict:
        return {}


def test_a_round_over_the_old_membership_does_not_answer_for_the_new():
    async def run() -> bool:
        router = Router(decode=[], prefill=["127.0.0.1:1"])
        workers = _Workers()
        readiness = Readiness(router, workers, Admission(None), interval_s=5.0)
        first = asyncio.create_task(readiness.ready())  # no decode worker yet: not ready
        await asyncio.sleep(0.05)
        router.set_workers(["127.0.0.1:2"], ["127.0.0.1:1"])  # the next push names one
        readiness.stale()
        second = asyncio.create_task(readiness.ready())
        done, _ = await asyncio.wait([second], timeout=10)  # its own round, not the held one
        workers.release.set()
        await asyncio.wait_for(first, 10)
        return bool(done) and second.result() and readiness.ok

    assert asyncio.run(run())
