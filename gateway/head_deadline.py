"""A deadline for each request head: a client that sends its headers byte by byte is cut off.

uvicorn (h11) bounds a head's size but not the time it takes to arrive, and any byte a
client sends cancels its keep-alive timer: a few hundred connections that each trickle a
byte now and then hold every `--max-connections` slot for as long as they like. Here each
connection gets `head_timeout_s` from the moment it opens, or from the end of its last
response, to deliver a complete request head; past it the gateway answers 408 and closes.
Once a head is in, the body has its own bound (`--body-timeout`, gateway/body_limit.py).

The bound is on the client's network, not on this host's speed: the event loop handles a
socket's pending bytes before a timer due in the same turn, so a head that has arrived is
never cut off because the loop ran late.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
# What a client of the gateway should expire its idle connections after: well below
# KEEP_ALIVE_S, so a connection it reuses is never one the gateway is closing just then
# (httpx's default, 5 s, races the gateway's close on every reuse near the 5 s mark).
CLIENT_KEEPALIVE_EXPIRY_S = 2.0

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 25\r\nconnection: close\r\n\r\n" \
       b"request head not received"


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head (`http=` of its Config)."""

    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head has been parsed
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next head has the same deadline, counted from now

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being sent
            self.transport.write(_408)
        self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": seconds})
