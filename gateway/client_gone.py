"""Noticing a client that leaves, at any moment of its request.

uvicorn answers `receive()` with `http.disconnect` the moment a client's connection drops
(once its body has been read, `receive()` waits for nothing else). `unless_gone` runs a
piece of the request's work beside that wait and cancels the work when the client goes
first: a queued or prefilling request's gRPC call is cancelled then, not when its first
token would have been written to nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the work it waited for ended (the work was cancelled)."""


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # an empty trailing body message


async def unless_gone(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """`await work`, or raise ClientGone as soon as the client disconnects (cancelling it).

    Only after the request's body is read: until then `receive()` carries the body."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this coroutine cancelled (the server shutting down) cancels the work too
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()  # it ended first (or with the client: its answer is done anyway)
    if not watch.cancelled():
        watch.exception()  # a receive() that failed counts as gone (and its error is not left unread)
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientGone()
