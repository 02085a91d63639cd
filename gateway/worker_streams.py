"""Every request this gateway has on one decode worker, on one Streams call.

`WorkerStreams.open()` returns a `StreamCall`, read like the per-request gRPC call it
replaces (`read()`, `cancel()`, `add_done_callback`, grpc.RpcError for a failure): the rest
of the gateway (gateway/decode_stream.py: replays and hand-offs; gateway/completions/answer.py) is
the same whichever it reads. One task reads the call and hands each stream its part of
every step's message; one task writes the opens and cancels gathered since its last write
as one message. The reader never waits for a stream's consumer (its client may be slow):
a stream's messages queue on it, so a slow client holds its own tokens, not the others'.

When the call breaks (the worker died, its connection dropped), every stream on it fails
with UNAVAILABLE, as each per-request call did, and the next open starts a new call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc import aio

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StreamError(grpc.RpcError):
    """A stream's failure, as a per-request call's RpcError would report it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


_NOT_SERVED = pb.Served()


class Tokens:
    """A step's plain tokens for one stream, read as the GenerateResponse it stands for
    (no finish reason, no error, no logprobs; `served` on a stream's first message only): no
    protobuf message made per stream per step."""

    __slots__ = ("served", "token_ids")
    finish_reason = pb.FINISH_NONE
    error = pb.Error()
    logprobs = ()
    usage = pb.Usage()
    timings = pb.Timings()

    def __init__(self, token_ids: list[int], served: pb.Served = _NOT_SERVED):
        self.token_ids, self.served = token_ids, served

    def HasField(self, name: str) -> bool:  # as GenerateResponse.HasField answers it
        return name == "served" and self.served is not _NOT_SERVED


_END = object()  # a stream's queue: nothing more will come


class StreamCall:
    """One request's stream on a worker's Streams call."""

    def __init__(self, owner: WorkerStreams, stream: int, timeout_s: float | None):
        self._owner, self.stream = owner, stream
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._callbacks: list[Callable[[StreamCall], None]] = []
        # One timer for the stream's deadline, not one per read (a read per token would cost a
        # task and a timer each).
        self._timer = None if timeout_s is None else asyncio.get_running_loop().call_later(timeout_s, self._expire)

    async def read(self):
        """The next GenerateResponse; raises StreamError when the stream failed, or
        asyncio.CancelledError once it was cancelled."""
        queue = self._queue
        if not queue.empty():
            item = queue.get_nowait()
        elif self._done:
            raise asyncio.CancelledError()
        else:
            item = await queue.get()
        if item is _END:
            raise asyncio.CancelledError()
        if isinstance(item, StreamError):
            raise item
        return item

    def cancel(self) -> bool:
        """Its client left (or a stop string ended it here): the worker aborts the request."""
        if self._done:
            return False
        self._owner._cancel(self.stream)
        self._finish()
        self._queue.put_nowait(_END)
        return True

    def done(self) -> bool:
        return self._done

    def _expire(self) -> None:
        """Its deadline passed: the worker aborts it, and its reader gets DEADLINE_EXCEEDED."""
        if self._done:
            return
        self._owner._cancel(self.stream)
        self._last(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))

    def add_done_callback(self, callback: Callable[[StreamCall], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    # -- the owner's side -------------------------------------------------------------------

    def _push(self, item) -> None:
        self._queue.put_nowait(item)

    def _last(self, item) -> None:
        """Its last message or its failure: the worker holds nothing of it any more."""
        self._queue.put_nowait(item)
        self._finish()

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self._owner._forget(self.stream)
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


class WorkerStreams:
    """This gateway's one Streams call to one decode worker, opened on first use."""

    def __init__(self, channel: aio.Channel, address: str):
        self._stub = pb_grpc.DecodeWorkerStub(channel)
        self.address = address
        self._call = None
        self._streams: dict[int, StreamCall] = {}
        self._next = 0
        self._opens: list[pb.StreamOpen] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request: pb.GenerateRequest, timeout_s: float | None) -> StreamCall:
        if self._call is None:
            self._start()
        self._next = (self._next + 1) & 0xFFFFFFFF
        sc = StreamCall(self, self._next, timeout_s)
        self._streams[sc.stream] = sc
        self._opens.append(pb.StreamOpen(stream=sc.stream, request=request, timeout_s=timeout_s or 0.0))
        self._wake.set()
        return sc

    def _cancel(self, stream: int) -> None:
        if self._call is not None and stream in self._streams:
            self._cancels.append(stream)
            self._wake.set()

    def _forget(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def _start(self) -> None:
        self._call = call = self._stub.Streams()
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(call)), loop.create_task(self._read(call))]

    async def _write(self, call) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._call is not call:
                    return
                opens, self._opens = self._opens, []
                cancels, self._cancels = self._cancels, []
                if opens or cancels:
                    await call.write(pb.StreamsUp(opens=opens, cancels=cancels))
        except grpc.RpcError as e:
            self._broken(call, e)
        except Exception as e:  # a write on a call that ended under it
            log.info("Streams call to %s: write failed: %r", self.address, e)
            self._broken(call, None)

    async def _read(self, call) -> None:
        try:
            while True:
                down = await call.read()
                if down is aio.EOF:
                    self._broken(call, None)
                    return
                self._deliver(down)
        except grpc.RpcError as e:
            self._broken(call, e)
        except asyncio.CancelledError:
            self._broken(call, None)
            raise

    def _deliver(self, down: pb.StreamsDown) -> None:
        streams = self._streams
        # How a stream was served comes with its first message, whichever list that is in.
        served = {s.stream: s.served for s in down.served} if down.served else None
        start = 0
        tokens = down.token_ids
        for stream, count in zip(down.streams, down.counts):
            sc = streams.get(stream)
            if sc is not None:
                first = served.pop(stream, None) if served else None
                sc._push(Tokens(tokens[start:start + count]) if first is None
                         else Tokens(tokens[start:start + count], first))
            start += count
        for event in down.events:
            sc = streams.get(event.stream)
            if sc is None:
                continue
            if served and event.stream in served and event.HasField("response"):
                event.response.served.CopyFrom(served.pop(event.stream))
            if not event.HasField("response"):
                sc._last(StreamError(_CODES.get(event.refused_code, grpc.StatusCode.UNKNOWN), event.refused_message))
            elif event.response.finish_reason != pb.FINISH_NONE:
                sc._last(event.response)
            else:
                sc._push(event.response)

    def _broken(self, call, error: grpc.RpcError | None) -> None:
        """The call ended: every stream still on it fails as its own call would have."""
        if self._call is not call:
            return
        self._call = None
        self._wake.set()  # the writer sees the call replaced and ends
        code = error.code() if error is not None and callable(getattr(error, "code", None)) else grpc.StatusCode.UNAVAILABLE
        details = error.details() if error is not None and callable(getattr(error, "details", None)) else "the call ended"
        if self._streams:
            log.info("Streams call to %s ended (%s): %d streams fail", self.address, code.name, len(self._streams))
        for sc in list(self._streams.values()):
            sc._last(StreamError(code, f"decode worker stream ended: {details}"))
        self._streams.clear()
        call.cancel()

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for task in self._tasks:
            task.cancel()
