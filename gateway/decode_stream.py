"""One choice's Generate stream, which outlives the decode worker serving it.

`DecodeStream` reads like the gRPC call it wraps (`read()`, `cancel()`). When the decode
worker fails mid-stream (the call breaks or ends early, or the worker ends the request
with an INTERNAL error: it shut down, or its steps kept failing), the stream is replayed
on another decode worker: the same request with the tokens it already produced as
`output_token_ids`, the KV of all but the last of them filled there by a prefill worker or
computed locally. A drained worker hands its streams off the same way (HANDED_OFF: the
deploy controller's drain, deploy/drain.py), and keeps their KV for the taker, named as
the replay's `kv_source`: the taker copies it over NIXL instead of prefilling
(decode/kv_source.py). They count as output, so the replay goes on exactly
where the first worker stopped: max_tokens, penalties, the seeded sampler's positions
and the grammar's state all follow them (engine/llm_engine.py `add_request`). Its
messages then follow on the same stream, nothing duplicated or missing, and the reader
(gateway/completions/answer.py) never sees the break. At most MAX_REPLAYS per choice; past that,
with no other decode worker, or when the request's own deadline ran out, the reader gets
the failure as it came.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from common import trace
from gateway.errors import APIError
from gateway.metrics import RETRIES
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)

MAX_REPLAYS = 2  # per choice: a second dead worker in a row is bad luck, a third is the request
MAX_HAND_OFFS = 8  # per choice: drains are planned, but a bound all the same

# Opens a replay of the request on a decode worker other than those given: (address, call, first message).
Reopen = Callable[[pb.GenerateRequest, set[str]], Awaitable[tuple[str, object, pb.GenerateResponse]]]


class DecodeStream:
    """The messages of one choice after its first (`first` is the caller's already)."""

    def __init__(self, req: pb.GenerateRequest, address: str, call, first: pb.GenerateResponse, reopen: Reopen):
        self.req, self.address, self.call, self.first, self.reopen = req, address, call, first, reopen
        self.tokens: list[int] = list(first.token_ids)  # what the client has been sent, or will be
        self.request_id = req.request_id  # the id on the worker serving it now
        self.replays = 0  # after a failure
        self.hand_offs = 0  # from a drained worker
        self.finished = _ended(first)  # its last message came: the worker holds nothing of it

    def _seen(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        self.finished = _ended(msg)
        return msg

    def cancel(self) -> None:
        self.call.cancel()

    async def read(self) -> pb.GenerateResponse:
        """The next message, from whichever worker serves the choice now."""
        try:
            msg = await self.call.read()
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # this reader is being cancelled (its client left)
            return await self._replay_or(asyncio.CancelledError(), "its call was cancelled under it")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise  # the request's own time is up: no replay has any left
            return await self._replay_or(e, f"the stream broke ({e.code().name})")
        if msg is grpc.aio.EOF:
            return await self._replay_or(msg, "it ended the stream early")
        if msg.finish_reason == pb.ERROR and msg.error.code == pb.HANDED_OFF:
            return await self._replay_or(msg, msg.error.message, handed_off=True)
        if msg.finish_reason == pb.ERROR and msg.error.code == pb.INTERNAL:
            return await self._replay_or(msg, msg.error.message)
        self.tokens += msg.token_ids
        return self._seen(msg)

    async def _replay_or(self, failure, why: str, handed_off: bool = False):
        """The replay's first message, or `failure` (raised or returned) when there is none.
        A hand-off (a drained worker's) does not count against MAX_REPLAYS, only against
        MAX_HAND_OFFS: a request may meet several drains in a row of planner moves."""
        rid, failed = self.req.request_id, self.address
        spent = self.hand_offs >= MAX_HAND_OFFS if handed_off else self.replays >= MAX_REPLAYS
        if spent or len(self.tokens) >= self.req.params.max_tokens:
            log.info("request %s: decode worker %s failed mid-stream (%s); no replay left", rid, failed, why)
            return _give(failure)
        self.call.cancel()
        replay = pb.GenerateRequest()
        replay.CopyFrom(self.req)
        if handed_off:
            self.hand_offs += 1
        else:
            self.replays += 1
        replay.request_id = f"{self.req.request_id}-replay{self.replays + self.hand_offs}"
        replay.output_token_ids[:] = self.tokens
        if handed_off:  # the drained worker kept its KV for the taker (if it could: else the taker prefills)
            replay.kv_source.CopyFrom(pb.KVSource(address=failed, request_id=self.request_id))
        try:
            self.address, self.call, first = await self.reopen(replay, {failed})
        except APIError as e:
            log.info("request %s: decode worker %s failed mid-stream (%s); no worker to replay it on: %s", rid,
                     failed, why, e.message)
            return _give(failure)
        self.request_id = replay.request_id
        RETRIES.labels("handed_off" if handed_off else "mid_stream").inc()
        trace.event(rid, "replayed", failed_worker=failed, decode_worker=self.address, as_id=replay.request_id,
                    output_tokens=len(self.tokens), kv_source=failed if handed_off else None)
        log.info("request %s: decode worker %s %s (%s); replayed on %s as %s after %d tokens", rid, failed,
                 "handed it off" if handed_off else "failed mid-stream", why, self.address, replay.request_id,
                 len(self.tokens))
        self.tokens += first.token_ids
        return self._seen(first)


def _ended(msg: pb.GenerateResponse) -> bool:
    """The request's last message, ending it on the worker by its own end (not an error)."""
    return msg.finish_reason in (pb.STOP, pb.LENGTH)


def _give(failure):
    if isinstance(failure, BaseException):
        raise failure
    return failure
