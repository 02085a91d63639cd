"""The gateway's gRPC side: requests' streams on the decode workers (one Streams call per
worker: gateway/worker_streams.py), health and stats of all."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc import aio

from gateway.worker_streams import StreamCall, WorkerStreams
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Backend:
    """Channels to the workers, one per address. A worker that leaves the membership keeps
    its channel until its last Generate stream ends (scale-down drains it: the deploy
    controller's drain bound, not this side, says how long that may take)."""

    def __init__(self, decode: list[str], prefill: list[str], per_request: bool = False):
        self.per_request = per_request  # one Generate call per request instead of the worker's Streams call
        self._channels: dict[str, aio.Channel] = {}
        self._decode_calls: dict[str, WorkerStreams] = {}  # the one Streams call per decode worker
        self._streams: dict[str, int] = {}  # Generate calls open per address
        self._closing: set[asyncio.Task] = set()
        self.decode = decode
        self.prefill = prefill

    async def set_workers(self, decode: list[str], prefill: list[str]) -> None:
        """New membership; channels to workers that left close once their streams end."""
        self.decode, self.prefill = list(decode), list(prefill)
        gone = [a for a in self._channels if not self._member(a) and not self._streams.get(a)]
        await asyncio.gather(*(self._close(a) for a in gone))

    def _member(self, address: str) -> bool:
        return address in self.decode or address in self.prefill

    async def _close(self, address: str) -> None:
        if self._member(address) or self._streams.get(address):
            return  # back in the membership, or a stream opened since: keep it
        streams = self._decode_calls.pop(address, None)
        if streams is not None:
            await streams.close()
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()
            log.info("channel to %s closed (no longer a member, no stream open)", address)

    def _channel(self, address: str) -> aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = auth.aio_channel(address)
        return ch

    def generate(self, address: str, request: pb.GenerateRequest, timeout: float) -> StreamCall | aio.UnaryStreamCall:
        """The request's stream on that decode worker's Streams call (opened on first use), or
        its own Generate call (`per_request`)."""
        if self.per_request:
            call = pb_grpc.DecodeWorkerStub(self._channel(address)).Generate(request, timeout=timeout)
        else:
            streams = self._decode_calls.get(address)
            if streams is None:
                streams = self._decode_calls[address] = WorkerStreams(self._channel(address), address)
            call = streams.open(request, timeout)
        self._streams[address] = self._streams.get(address, 0) + 1
        call.add_done_callback(lambda _: self._stream_ended(address))
        return call

    def _stream_ended(self, address: str) -> None:
        left = self._streams[address] = self._streams[address] - 1
        if left == 0:
            del self._streams[address]
            if not self._member(address):  # it left while this stream ran: the last one is done
                task = asyncio.get_running_loop().create_task(self._close(address))
                self._closing.add(task)  # the loop holds tasks weakly
                task.add_done_callback(self._closing.discard)

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self._channel(address))

    async def health(self, address: str, deep: bool, timeout: float = 10.0) -> pb.HealthResponse:
        """The worker's own verdict (deep: is its engine loop making progress?); a call that
        fails or gets no answer in `timeout` is a failed check, with the reason as its detail."""
        answer = await _unary(self._stub(address).Health(pb.HealthRequest(deep=deep), timeout=timeout))
        return answer if isinstance(answer, pb.HealthResponse) else pb.HealthResponse(ok=False,
                                                                                     detail=f"no answer: {answer}")

    async def stats(self, address: str, request: pb.StatsRequest | None = None,
                    timeout: float = 1.0) -> pb.StatsResponse | None:
        answer = await _unary(self._stub(address).Stats(request or pb.StatsRequest(), timeout=timeout))
        return answer if isinstance(answer, pb.StatsResponse) else None

    async def metrics(self, address: str, timeout: float = 2.0) -> pb.MetricsResponse | None:
        """The worker process's Prometheus registry; None if it does not answer in `timeout`."""
        answer = await _unary(self._stub(address).Metrics(pb.MetricsRequest(), timeout=timeout))
        return answer if isinstance(answer, pb.MetricsResponse) else None

    async def all_metrics(self) -> list[pb.MetricsResponse]:
        """Every answering worker's registry (for the one scrape: gateway/scrape.py)."""
        results = await asyncio.gather(*(self.metrics(a) for a in self.decode + self.prefill))
        return [r for r in results if r is not None]

    async def all_stats(self, requests: dict[str, pb.StatsRequest] | None = None) -> dict[str, pb.StatsResponse | None]:
        """Every worker's Stats; `requests`: what to ask each (by address; plain Stats otherwise)."""
        addresses = self.decode + self.prefill
        requests = requests or {}
        results = await asyncio.gather(*(self.stats(a, requests.get(a)) for a in addresses))
        return dict(zip(addresses, results))

    async def release_kept(self, address: str, kept_request_id: str) -> None:
        """Tell a drained decode worker that the hand-off of `kept_request_id` was given up:
        it releases the KV it kept for the taker now, not at the end of its hold (its drain
        waits on it). Best effort: a worker that does not answer releases it then anyway."""
        try:
            await pb_grpc.PrefillWorkerStub(self._channel(address)).Abort(
                pb.AbortRequest(request_id=kept_request_id), timeout=10)
        except grpc.RpcError as e:
            log.info("request %s: %s did not take the release of its kept KV (%s); it ends with its hold",
                     kept_request_id, address, e.code().name)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self._decode_calls.values()))
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))


async def _unary(call):
    """A unary call's answer, or why there is none (a status name): it failed, or its channel
    was closed under it, when a membership change closes a departed worker's channel (gRPC's
    aio raises CancelledError in the caller then; a caller that is itself being cancelled
    still is)."""
    try:
        return await call
    except grpc.RpcError as e:
        return e.code().name
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        return "CHANNEL_CLOSED"
