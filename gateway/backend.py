"""The gateway's gRPC side: Generate streams to decode workers, health and stats of all."""

from __future__ import annotations

import asyncio

import grpc
from grpc import aio

from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc


class Backend:
    def __init__(self, decode: list[str], prefill: list[str]):
        self._channels: dict[str, aio.Channel] = {}
        self.decode = decode
        self.prefill = prefill

    async def set_workers(self, decode: list[str], prefill: list[str]) -> None:
        """New membership; channels to workers that left are closed (their calls in flight end)."""
        self.decode, self.prefill = list(decode), list(prefill)
        gone = [a for a in self._channels if a not in self.decode and a not in self.prefill]
        await asyncio.gather(*(self._channels.pop(a).close(grace=5.0) for a in gone))

    def _channel(self, address: str) -> aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = auth.aio_channel(address)
        return ch

    def generate(self, address: str, request: pb.GenerateRequest, timeout: float) -> aio.UnaryStreamCall:
        return pb_grpc.DecodeWorkerStub(self._channel(address)).Generate(request, timeout=timeout)

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self._channel(address))

    async def health(self, address: str, deep: bool, timeout: float = 10.0) -> pb.HealthResponse:
        """The worker's own verdict (deep: is its engine loop making progress?); a call that
        fails or gets no answer in `timeout` is a failed check, with the reason as its detail."""
        try:
            return await self._stub(address).Health(pb.HealthRequest(deep=deep), timeout=timeout)
        except grpc.RpcError as e:
            return pb.HealthResponse(ok=False, detail=f"no answer: {e.code().name}")

    async def stats(self, address: str, timeout: float = 1.0) -> pb.StatsResponse | None:
        try:
            return await self._stub(address).Stats(pb.StatsRequest(), timeout=timeout)
        except grpc.RpcError:
            return None

    async def all_stats(self) -> dict[str, pb.StatsResponse | None]:
        addresses = self.decode + self.prefill
        results = await asyncio.gather(*(self.stats(a) for a in addresses))
        return dict(zip(addresses, results))

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))
