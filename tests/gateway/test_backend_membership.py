"""A worker's channel is closed when it leaves the membership (gateway/backend.py): a Stats,
Metrics or Health call in flight on it then ends as a worker that did not answer, never as
a CancelledError up the caller's stack (a /metrics scrape during a planner's move answered
500 that way)."""

from __future__ import annotations

import asyncio

from grpc import aio

from bench.harness.worker_procs import free_port
from gateway.backend import Backend
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc


class _Slow(pb_grpc.WorkerServicer):
    """Counts the calls that reached it, and answers none of them before the test is over."""

    def __init__(self, expected: int):
        self.arrived, self.expected, self.all_in = 0, expected, asyncio.Event()

    async def Metrics(self, request, context):
        self.arrived += 1
        if self.arrived == self.expected:
            self.all_in.set()
        await asyncio.sleep(300)
        return pb.MetricsResponse()

    Stats = Health = Metrics


def test_calls_in_flight_when_their_worker_leaves_end_as_no_answer():
    async def scenario():
        port = free_port()
        server, slow = aio.server(), _Slow(expected=3)
        pb_grpc.add_WorkerServicer_to_server(slow, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        address = f"127.0.0.1:{port}"
        backend = Backend([address], [])
        try:
            calls = [asyncio.create_task(backend.metrics(address, timeout=60)),
                     asyncio.create_task(backend.stats(address, timeout=60)),
                     asyncio.create_task(backend.health(address, deep=True, timeout=60))]
            await asyncio.wait_for(slow.all_in.wait(), 60)  # all three in flight (the server holds them)
            await backend.set_workers([], [])  # it left: its channel closes under the calls
            metrics, stats, health = await asyncio.wait_for(asyncio.gather(*calls), 30)
            assert metrics is None and stats is None
            assert not health.ok and health.detail == "no answer: CHANNEL_CLOSED", health
        finally:
            await backend.close()
            await server.stop(0)

    asyncio.run(scenario())
