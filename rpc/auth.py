"""A shared secret on the internal gRPC (gateway, controller and workers).

Every process of a deployment gets the same PDSERVE_INTERNAL_TOKEN in its environment
(`pdserve serve` makes a random one unless the config names one). Workers then refuse any
call without it (UNAUTHENTICATED), and every client here sends it as `x-pdserve-token`
metadata, but only to a peer that first proved it holds the token too (rpc/proof.py:
an address handed on by someone else may be anyone's). With the variable unset (workers started by hand for local use) nothing is
checked, so such a worker binds loopback only (`require_token_off_loopback`). The token is
compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress

import grpc
from grpc import aio

from common import envs
from rpc import proof, transport

ENV = envs.INTERNAL_TOKEN
HEADER = "x-pdserve-token"


def internal_token() -> str | None:
    return envs.internal_token()


def is_loopback(host: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1, localhost); a host name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str) -> None:
    """A worker without the internal token checks no caller: it may listen on loopback only."""
    if internal_token() is None and not is_loopback(host):
        raise SystemExit(f"refusing to listen on {host} without {ENV}: with no token this worker would take "
                         "calls from anyone who reaches it; set the token (pdserve serve does) or bind 127.0.0.1")


class ServerAuth(grpc.ServerInterceptor):
    """Rejects calls whose metadata lacks the token (a no-op without one); `Prove` alone is
    served to anyone, since a client asks it before it sends the token."""

    def __init__(self, token: str | None):
        self._token = token.encode() if token else None

    def _allowed(self, metadata) -> bool:
        given = next((v for k, v in metadata or () if k == HEADER), "")
        return hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._token is None or handler_call_details.method == proof.METHOD or \
                self._allowed(handler_call_details.invocation_metadata):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

        kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(deny, handler.request_deserializer, handler.response_serializer)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


class _ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str, address: str):
        self._pair = (HEADER, token)
        self._proof = proof.Proof(token, address)

    def _details(self, details):
        self._proof.ensure(details.timeout)
        return _Details(details, [*(details.metadata or ()), self._pair])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _AioAuth:
    def __init__(self, token: str, check: proof.AioProof):
        self._pair = (HEADER, token)
        self._proof = check

    async def _details(self, details):
        await self._proof.ensure(details.timeout)
        metadata = aio.Metadata(*(details.metadata or ()), self._pair)
        return aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                     details.wait_for_ready)


# One class per kind: grpc.aio files an interceptor under the first kind it matches, never two.
class _AioUnaryAuth(_AioAuth, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(await self._details(details), request)


class _AioStreamAuth(_AioAuth, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(await self._details(details), request)


class _AioBidiAuth(_AioAuth, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(await self._details(details), request_iterator)


# A peer that goes silent (a host that froze or fell off the network, its TCP connection
# left open) fails the calls to it within PEER_SILENCE_S, as UNAVAILABLE, instead of each
# waiting for its whole deadline: a ping every KEEPALIVE_S, PING_TIMEOUT_S to answer any ping
# (keepalive or flow control). Pings go even with no call open. PDSERVE_PEER_SILENCE_S, 15 by
# default (common/envs.py).
PEER_SILENCE_S = envs.peer_silence_s()
KEEPALIVE_S, PING_TIMEOUT_S = PEER_SILENCE_S * 2 / 3, PEER_SILENCE_S / 3
# (gRPC core waits `ping_timeout_ms`, a minute by default, for a ping's answer whatever
# `keepalive_timeout_ms` says: both are set.)
_PINGS = [("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
          ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
          ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000))]
KEEPALIVE = _PINGS + [("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
# What a server must allow for those pings (by default it answers pings more often than
# every 5 minutes with no call open by closing the connection: GOAWAY "too_many_pings"): half
# the interval, and at most half the default one, since a client may ping at the default while
# this side has a longer one.
SERVER_KEEPALIVE = _PINGS + [("grpc.keepalive_permit_without_calls", 1),
                             ("grpc.http2.min_ping_interval_without_data_ms", int(min(KEEPALIVE_S, 10) * 500))]


# The largest message either side of an internal call takes (gRPC's own default receive
# bound is 4 MiB): a merged StreamsDown of a step with many requests' top-logprobs, a Stats
# page of the prefix cache's hashes (worker/kv_event_log.py pages a resync well under it).
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
CHANNEL_OPTIONS = KEEPALIVE + MESSAGE_LIMITS  # every channel to a worker
SERVER_OPTIONS = SERVER_KEEPALIVE + MESSAGE_LIMITS  # every worker's server


def channel(address: str) -> grpc.Channel:
    """A channel to a worker that sends the internal token (if this process has one), once
    the worker has proved it holds it; else its first call raises proof.NotProven."""
    ch = transport.channel(address, CHANNEL_OPTIONS)
    token = internal_token()
    if not token:
        return ch
    interceptor = _ClientAuth(token, address)
    ch = grpc.intercept_channel(ch, interceptor)
    ch.pdserve_proof = interceptor._proof
    return ch


def prove(ch: grpc.Channel, timeout_s: float) -> None:
    """Have `ch`'s peer prove itself now (a round trip, the first time only), so that a later
    call on a thread that must not wait (an engine loop) finds it done. Raises
    proof.NotProven, or the RpcError of a peer that cannot be reached; a no-op without a token."""
    check = getattr(ch, "pdserve_proof", None)
    if check is not None:
        check.ensure(timeout_s)


def aio_channel(address: str) -> aio.Channel:
    token = internal_token()
    if not token:
        return transport.aio_channel(address, CHANNEL_OPTIONS)
    check = proof.AioProof(token, address)
    return transport.aio_channel(address, CHANNEL_OPTIONS,
                                 interceptors=[_AioUnaryAuth(token, check), _AioStreamAuth(token, check),
                                               _AioBidiAuth(token, check)])
