"""What one call's streams receive, gathered per engine step and sent as one message.

The engine loop delivers each request's news to its `Outlet`: plain new tokens go into the
columns of the batch being gathered (three list appends, no message per token), anything
else (logprobs, a request's last message, an open refused) is an event. How a request was
served (pb.Served: which prefill worker's KV, or why it was prefilled here) goes with its
first message, in its own list that the reader takes before the columns. At the end of a
step the loop calls `flush()`: what it gathered becomes ready, and the call's thread, waiting
in `take()`, sends it as one StreamsDown. The loop never waits for the call: when the
thread (or the gateway behind it) falls behind, the steps ready and not yet sent merge into
the next message, in order, so a slow reader slows its own streams and costs memory in
proportion to the tokens it has not read, never a step of the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rpc import pdserve_pb2 as pb


class _Gathered:
    __slots__ = ("streams", "counts", "token_ids", "events", "served")

    def __init__(self) -> None:
        self.streams: list[int] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []
        self.events: list[pb.StreamEvent] = []
        self.served: list[pb.StreamServed] = []

    def __bool__(self) -> bool:
        return bool(self.streams) or bool(self.events) or bool(self.served)

    def extend(self, other: _Gathered) -> None:
        self.streams += other.streams
        self.counts += other.counts
        self.token_ids += other.token_ids
        self.events += other.events
        self.served += other.served


class StepBatches:
    """The messages of one call (a gateway's Streams, or one Generate): the engine loop
    gathers and flushes, the call's thread takes."""

    def __init__(self) -> None:
        self._gathering = _Gathered()  # this step's (loop thread only)
        self._ready = _Gathered()  # flushed, not yet taken (under the lock)
        self._cond = threading.Condition()
        self._dirty = False
        self.closed = False

    def outlet(self, stream: int, on_last: Callable[[], None] | None = None) -> Outlet:
        return Outlet(self, stream, on_last)

    # -- the engine loop's side -----------------------------------------------------------

    def tokens(self, stream: int, token_ids: list[int]) -> None:
        g = self._gathering
        g.streams.append(stream)
        g.counts.append(len(token_ids))
        g.token_ids += token_ids
        self._dirty = True

    def event(self, event: pb.StreamEvent) -> None:
        self._gathering.events.append(event)
        self._dirty = True

    def served(self, stream: int, served: pb.Served) -> None:
        """How the stream's request was served: before (or with) its first message."""
        self._gathering.served.append(pb.StreamServed(stream=stream, served=served))
        self._dirty = True

    def flush(self) -> None:
        """What was gathered is ready to send (a no-op when nothing was)."""
        if not self._dirty:
            return
        gathered, self._gathering, self._dirty = self._gathering, _Gathered(), False
        with self._cond:
            self._ready.extend(gathered)
            self._cond.notify()

    def refuse(self, stream: int, code: int, message: str) -> None:
        """An open that never reached the engine (any thread): sent at once."""
        with self._cond:
            self._ready.events.append(pb.StreamEvent(stream=stream, refused_code=code, refused_message=message))
            self._cond.notify()

    # -- the call's side ------------------------------------------------------------------

    def take(self, timeout_s: float) -> pb.StreamsDown | None:
        """Everything ready, as one message; None if nothing came in `timeout_s` or the
        batches are closed."""
        with self._cond:
            if not self._ready and not self.closed:
                self._cond.wait(timeout_s)
            if not self._ready:
                return None
            ready, self._ready = self._ready, _Gathered()
        return pb.StreamsDown(streams=ready.streams, counts=ready.counts, token_ids=ready.token_ids,
                              events=ready.events, served=ready.served)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Outlet:
    """Where one request's responses go: its stream on a call. The decode worker calls
    `tokens` for a plain step's tokens and `put` for any other message; the last message
    (a finish reason set) runs `on_last` once."""

    __slots__ = ("batches", "stream", "_on_last")

    def __init__(self, batches: StepBatches, stream: int, on_last: Callable[[], None] | None):
        self.batches, self.stream, self._on_last = batches, stream, on_last

    def tokens(self, token_ids: list[int]) -> None:
        self.batches.tokens(self.stream, token_ids)

    def served(self, served: pb.Served) -> None:
        """How the request was served (once, before its first message)."""
        self.batches.served(self.stream, served)

    def put(self, msg: pb.GenerateResponse) -> None:
        self.batches.event(pb.StreamEvent(stream=self.stream, response=msg))
        if msg.finish_reason != pb.FINISH_NONE and self._on_last is not None:
            on_last, self._on_last = self._on_last, None
            on_last()

    def flush(self) -> None:
        self.batches.flush()


def responses(down: pb.StreamsDown):
    """A StreamsDown of one stream's call (a Generate's) as that stream's GenerateResponses, in
    order; its `served`, if any, on the first of them."""
    served = down.served[0].served if down.served else None
    start = 0
    for count in down.counts:
        msg = pb.GenerateResponse(token_ids=down.token_ids[start:start + count])
        start += count
        if served is not None:
            msg.served.CopyFrom(served)
            served = None
        yield msg
    for event in down.events:
        if served is not None:
            event.response.served.CopyFrom(served)
            served = None
        yield event.response
