"""A deadline for each request head: a client that sends its headers byte by byte is cut off.

uvicorn (h11) bounds a head's size but not the time it takes to arrive, and any byte a
client sends cancels its keep-alive timer: a few hundred connections that each trickle a
byte now and then hold every `--max-connections` slot for as long as they like. Here each
connection gets `head_timeout_s` from the moment it opens, or from the end of its last
response, to deliver a complete request head; past it the gateway answers 408 and closes.
Once a head is in, the body has its own bound (`--body-timeout`, gateway/body_limit.py);
a request answered before its body was all in (that 408, a 413) has its connection closed
with the answer, since the rest of the body would be read with no deadline.

Deadlines bound how long one connection can be held; `--max-connections-per-ip` bounds how
many one client address holds while they run (gateway/per_ip_cap.py): a connection counts
from the moment it opens, or from the first byte of its next request, until its whole
request (head and body) is in. Past the cap a new connection from that address is answered
429 and closed at once, before it can hold a slot; an idle keep-alive connection whose next
request would pass it is closed the same way.

The bound is on the client's network, not on this host's speed: the event loop handles a
socket's pending bytes before a timer due in the same turn, so a head that has arrived is
never cut off because the loop ran late.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body
from gateway.per_ip_cap import PerIpCap

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
# What a client of the gateway should expire its idle connections after: well below
# KEEP_ALIVE_S, so a connection it reuses is never one the gateway is closing just then
# (httpx's default, 5 s, races the gateway's close on every reuse near the 5 s mark).
CLIENT_KEEPALIVE_EXPIRY_S = 2.0

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 25\r\nconnection: close\r\n\r\n" \
       b"request head not received"


def _too_many(limit: int, ip: str) -> bytes:
    body = json.dumps(error_body(429, f"too many connections from {ip} still sending a request (limit {limit})",
                                 code="too_many_connections")).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head, and a cap on each client
    address's connections still sending a request (`http=` of its Config)."""

    head_timeout_s: float = 10.0
    per_ip: PerIpCap | None = None  # shared by every connection of one server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False  # whether this connection counts against its address's cap now
        if self._enter():  # a fresh connection is there to send a request: it counts at once
            self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused, or being closed: nothing more is read
        if not self._counted and self.conn.their_state is h11.IDLE and not self._enter():
            return  # the first bytes of a keep-alive connection's next request, past the cap: refused
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head has been parsed
            self._cancel_head_timer()
        self._leave_once_received()

    def on_response_complete(self) -> None:
        early = self.conn.their_state is h11.SEND_BODY  # answered before its body was in (a 408, a 413)
        super().on_response_complete()
        if early and not self.transport.is_closing():
            self.transport.close()  # the rest of that body is never read: a trickle would hold it with no deadline
            return
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next head has the same deadline, counted from now
        pipelined = self.conn.their_state is h11.SEND_BODY or (self.conn.their_state is h11.IDLE
                                                                and self.conn.trailing_data[0])
        if pipelined and not self._counted and not self.transport.is_closing():
            self._enter()  # a next request already under way (pipelined): it counts from now
        self._leave_once_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._counted:
            self._counted = False
            self.per_ip.leave(self.client[0])
        super().connection_lost(exc)

    def _enter(self) -> bool:
        """Count this connection against its address's cap; past it, answer 429 and close."""
        if self.per_ip is None or self.client is None:
            return True
        if self.per_ip.enter(self.client[0]):
            self._counted = True
            return True
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being sent
            self.transport.write(_too_many(self.per_ip.limit, self.client[0]))
        self.transport.close()
        return False

    def _leave_once_received(self) -> None:
        """A whole request is in (or the connection is past requests): it no longer counts."""
        if self._counted and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._counted = False
            self.per_ip.leave(self.client[0])

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


def with_head_timeout(seconds: float, max_per_ip: int | None = None) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline and, if given, a cap
    on each address's connections still sending a request."""
    cap = PerIpCap(max_per_ip) if max_per_ip is not None else None
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": seconds, "per_ip": cap})
