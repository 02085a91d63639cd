"""A deadline for each request head: a client that sends its headers byte by byte is cut off.

uvicorn (h11) bounds a head's size but not the time it takes to arrive, and any byte a
client sends cancels its keep-alive timer: a few hundred connections that each trickle a
byte now and then hold every `--max-connections` slot for as long as they like. Here each
connection gets `head_timeout_s` from the moment it opens, or from the end of its last
response, to deliver a complete request head; past it the gateway answers 408 and closes.
Once a head is in, the body has its own bound (`--body-timeout`, gateway/front_door/body_limit.py);
a request answered before its body was all in (that 408, a 413) has its connection closed
with the answer, since the rest of the body would be read with no deadline.

Deadlines bound how long one connection can be held; `--max-connections-per-ip` bounds how
many one client address holds *stalled* while they run (gateway/front_door/per_ip_cap.py). A request
whose head and body arrive within `stall_grace_s` (from the connection's opening, or from
the first byte of its next request) never counts: a burst of a thousand fast requests from
one address (every client behind an L7 proxy has the proxy's address) is served whole. One
still incomplete past the grace counts against its address until it is all in; past the
cap it is answered a JSON 429 naming the cap, its reading half drained for a moment so the
client reads the answer (a close with unread bytes would be a TCP reset, which destroys the
answer in flight), then closed. A slow client holds at most the cap's worth of slots past
the grace, however slowly it sends.

The address is the peer's, or for a request from a trusted proxy (`--forwarded-allow-ips`,
gateway/front_door/trusted_proxies.py) the one its X-Forwarded-For names, once its head is in: a
proxy's stalled heads are not counted against the proxy's address (a proxy sends a head it
has already received whole; the head deadline still bounds it).

The bound is on the client's network, not on this host's speed: the event loop handles a
socket's pending bytes before a timer due in the same turn, so a head that has arrived is
never cut off because the loop ran late.
"""

from __future__ import annotations

import asyncio
import json
import math

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body
from gateway.front_door.connection_limit import ConnectionTurnover, over_limit, service_unavailable
from gateway.front_door.per_ip_cap import PerIpCap
from gateway.metrics import CONNECTION_REFUSALS
from gateway.front_door.trusted_proxies import TrustedProxies

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
# What a client of the gateway should expire its idle connections after: well below
# KEEP_ALIVE_S, so a connection it reuses is never one the gateway is closing just then
# (httpx's default, 5 s, races the gateway's close on every reuse near the 5 s mark).
CLIENT_KEEPALIVE_EXPIRY_S = 2.0

# A request head and body arriving within this many seconds never count against the
# per-address cap: many round trips of any real network. It bounds the client's network,
# not this host's speed (the loop reads pending bytes before it runs a timer due in the same turn).
STALL_GRACE_S = 2.0
# How long a refused connection's reading half is drained before the close: long enough for
# the client to read its 429, which it does as soon as it reads at all.
LINGER_S = 2.0

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 25\r\nconnection: close\r\n\r\n" \
       b"request head not received"


def _too_many(limit: int, ip: str, retry_after_s: float) -> bytes:
    """The JSON 429 of an address at its cap; Retry-After: when its first counted connection
    is cut off by its deadline at the latest."""
    body = json.dumps(error_body(429, f"too many stalled connections from {ip}: requests still being sent more "
                                      f"than {STALL_GRACE_S:g} s after they began (limit {limit})",
                                 code="too_many_connections")).encode()
    wait = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: %d\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (wait, len(body), body))


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head, and a cap on each client
    address's stalled connections (`http=` of its Config)."""

    head_timeout_s: float = 10.0
    body_deadline_s: float = math.inf  # a body's whole bound, from its head (gateway/front_door/body_limit.py)
    stall_grace_s: float = STALL_GRACE_S
    per_ip: PerIpCap | None = None  # shared by every connection of one server
    proxies: TrustedProxies = TrustedProxies()
    max_connections: int | None = None  # --max-connections (gateway/front_door/connection_limit.py)
    turnover: ConnectionTurnover = ConnectionTurnover(KEEP_ALIVE_S)  # one per server (with_head_timeout)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._app = self.app
        self.app = self._within_limit  # uvicorn's own limit (a plain-text 503) stays off

    async def _within_limit(self, scope, receive, send) -> None:
        """The app, unless the server is past --max-connections: then a JSON 503 whose
        Retry-After is when the connections over the limit close at the rate measured."""
        excess = 0 if self.max_connections is None else \
            over_limit(self.max_connections, len(self.connections), len(self.tasks) - 1)
        if not excess:
            await self._app(scope, receive, send)
            return
        CONNECTION_REFUSALS.labels("max_connections").inc()
        body, headers = service_unavailable(self.max_connections, self.turnover.wait_s(excess, self.loop.time()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._counted: str | None = None  # the address this connection counts against now, if it does
        self._ends_by = math.inf  # ... and when its deadline cuts it off at the latest
        self._head_deadline = math.inf  # when the head timer fires
        self._head_done_at: float | None = None  # when the current request's head was in
        self._sending = False  # a request of the client's is under way (opened, or its first bytes came)
        self._lingering = False  # answered and closing: what still comes is dropped unread
        self._arm_head_timer()
        self._begin_request()  # a fresh connection is there to send a request

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.transport.is_closing():
            return  # refused (the rest is drained unread), or being closed
        if not self._sending and self.conn.their_state is h11.IDLE:
            self._begin_request()  # the first bytes of a keep-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head has been parsed
            self._cancel(self._head_timer)
            if self._head_done_at is None:
                self._head_done_at = self.loop.time()  # its body's whole deadline counts from here
        self._end_once_received()

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()  # the client read its 429 and closed its side
        return super().eof_received()

    def on_response_complete(self) -> None:
        early = self.conn.their_state is h11.SEND_BODY  # answered before its body was in (a 408, a 413)
        super().on_response_complete()
        if early and not self.transport.is_closing():
            self._linger()  # the rest of that body is never parsed: a trickle would hold it with no deadline
            return
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next head has the same deadline, counted from now
        pipelined = self.conn.their_state is h11.SEND_BODY or (self.conn.their_state is h11.IDLE
                                                                and self.conn.trailing_data[0])
        if pipelined and not self._sending and not self.transport.is_closing():
            self._begin_request()  # a next request already under way (pipelined): its grace runs from now
        self._end_once_received()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._stall_timer, self._linger_timer):
            self._cancel(timer)
        self._uncount()
        self.turnover.closed(self.loop.time())
        super().connection_lost(exc)

    def _begin_request(self) -> None:
        """A request is under way: it has `stall_grace_s` to arrive whole before it counts."""
        self._sending = True
        self._head_done_at = None
        if self.per_ip is not None and self.client is not None:
            self._cancel(self._stall_timer)
            self._stall_timer = self.loop.call_later(self.stall_grace_s, self._stalled)

    def _end_once_received(self) -> None:
        """A whole request is in (or the connection is past requests): it no longer counts."""
        if self._sending and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._sending = False
            self._cancel(self._stall_timer)
            self._stall_timer = None
            self._uncount()

    def _stalled(self) -> None:
        """The grace ran out with the request still incomplete: count it against its address,
        or refuse it past the cap."""
        self._stall_timer = None
        if not self._sending or self._lingering or self.transport.is_closing() or self._counted is not None:
            return
        if self.flow is not None and self.flow.read_paused:  # the app has not read what came (our backlog)
            self._stall_timer = self.loop.call_later(self.stall_grace_s, self._stalled)
            return
        in_head = self.conn.their_state is h11.IDLE
        ip = self.client[0] if in_head else self.proxies.client(self.client[0], self.headers or ())
        if ip is None or (in_head and self.proxies.trusts(ip)):
            return  # a trusted proxy's head: the proxy received it whole; the head deadline bounds it
        now = self.loop.time()
        ends_by = self._head_deadline if in_head else (self._head_done_at or now) + self.body_deadline_s
        if self.per_ip.enter(ip, ends_by):
            self._counted, self._ends_by = ip, ends_by
        else:
            CONNECTION_REFUSALS.labels("stalled_per_ip").inc()
            self._refuse(_too_many(self.per_ip.limit, ip, self.per_ip.next_free_s(ip, now)))

    def _uncount(self) -> None:
        if self._counted is not None:
            self.per_ip.leave(self._counted, self._ends_by)
            self._counted = None

    def _refuse(self, answer: bytes) -> None:
        """Answer (unless an answer of ours is under way) and close, draining what the client
        still sends for up to LINGER_S so the answer is read, not reset."""
        self._lingering = True
        if self.cycle is not None and not self.cycle.response_complete:
            started = self.cycle.response_started
            self.cycle.disconnected = True  # the app sees the client gone; its answer goes nowhere
            self.cycle.message_event.set()
            if started:
                self.transport.close()
                return
        self.transport.write(answer)
        self._linger()

    def _linger(self) -> None:
        """Close once the answer is out, reading and dropping what the client still sends for
        up to LINGER_S: a close with unread bytes is a reset, which can destroy the answer
        before the client reads it."""
        self._lingering = True
        if self.transport.can_write_eof():  # not over TLS: there the answer's length tells the client it ended
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._cancel(self._head_timer)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        self._head_deadline = self.loop.time() + self.head_timeout_s

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._lingering or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being sent
            self.transport.write(_408)
            self._linger()
            return
        self.transport.close()


def with_head_timeout(seconds: float, max_per_ip: int | None = None, proxies: TrustedProxies | None = None,
                      stall_grace_s: float = STALL_GRACE_S, body_deadline_s: float = math.inf,
                      max_connections: int | None = None) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline and, if given, a cap
    on each address's stalled connections (`proxies`: whose X-Forwarded-For names the address;
    `body_deadline_s`: a body's whole bound, which says when a stalled body is cut off) and
    on the server's connections (`max_connections`, in place of uvicorn's limit_concurrency)."""
    cap = PerIpCap(max_per_ip) if max_per_ip is not None else None
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,),
                {"head_timeout_s": seconds, "per_ip": cap, "proxies": proxies or TrustedProxies(),
                 "stall_grace_s": stall_grace_s, "body_deadline_s": body_deadline_s,
                 "max_connections": max_connections, "turnover": ConnectionTurnover(KEEP_ALIVE_S)})
