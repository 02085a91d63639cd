"""A worker proves it holds the internal token before any client sends the token to it.

The token is a bearer secret: whoever receives it can call every worker. A client learns
worker addresses from others (the controller's membership push, the gateway's choice of
prefill worker), so an address could be anyone's. Before a channel's first call carries the
token, the client sends a fresh 32-byte nonce to `Prove` (the one method served without
the token) and the worker answers HMAC-SHA256(token, address it serves on, nonce). The
client checks it against the address it dialed: an impostor cannot answer, and one that
relays the nonce to a real worker gets an answer bound to that worker's address, not its
own. Only then does the token go out, on that channel, for good.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading

import grpc

from rpc import transport

METHOD = "/pdserve.Identity/Prove"
NONCE_BYTES = 32
DEFAULT_TIMEOUT_S = 30.0


def answer(token: str, address: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"pdserve-prove\n" + address.encode() + b"\n" + nonce, hashlib.sha256).digest()


def handler(token: str | None, address: str) -> grpc.GenericRpcHandler:
    """The server side, for `server.add_generic_rpc_handlers`: bytes in, bytes out."""

    def prove(nonce: bytes, context: grpc.ServicerContext) -> bytes:
        if token is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no internal token")
        if len(nonce) != NONCE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a nonce is {NONCE_BYTES} bytes")
        return answer(token, address, nonce)

    return grpc.method_handlers_generic_handler("pdserve.Identity",
                                                {"Prove": grpc.unary_unary_rpc_method_handler(prove)})


class NotProven(grpc.RpcError):
    """The peer at an address could not show it holds the token: nothing was sent to it."""

    def __init__(self, address: str, why: str):
        super().__init__(f"{address} did not prove it is a worker of this deployment: {why}")
        self._details = f"{address} did not prove it is a worker of this deployment ({why}); the token was not sent"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return self._details


def _check(token: str, address: str, nonce: bytes, reply: bytes) -> None:
    if not hmac.compare_digest(reply, answer(token, address, nonce)):
        raise NotProven(address, "wrong proof")


def _refused(address: str, e: grpc.RpcError) -> grpc.RpcError:
    """A peer that answers Prove with an error is not a worker of ours; one we could not
    reach is simply unavailable (the caller retries or moves on, as for any call)."""
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return e
    return NotProven(address, f"Prove answered {e.code().name}")


class ProofPending(grpc.RpcError):
    """The caller's deadline passed while another call on the channel was still proving the
    peer: a call waits for a proof at most its own timeout, whatever the prover's."""

    def __init__(self, address: str, timeout: float):
        super().__init__(f"{address}: its proof was still pending after {timeout:g}s")
        self._details = f"{address} has not proved it is a worker of this deployment yet (waited {timeout:g}s)"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return self._details


def _bound(timeout: float | None) -> float:
    """A Prove is answered by the peer's gRPC threads, never its engine loop: a network
    bound, however long the call it precedes may run (a stream's whole request)."""
    return DEFAULT_TIMEOUT_S if timeout is None else min(timeout, DEFAULT_TIMEOUT_S)


class Proof:
    """Once per channel, thread-safe: proven, or the reason it is not. A caller waits for
    another's proof in flight at most its own timeout (ProofPending past it)."""

    def __init__(self, token: str, address: str):
        self.token, self.address = token, address
        self._lock = threading.Lock()
        self._proven = False

    def ensure(self, timeout: float | None) -> None:
        if self._proven:
            return
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise ProofPending(self.address, timeout)
        try:
            if self._proven:
                return
            nonce = secrets.token_bytes(NONCE_BYTES)
            with transport.channel(self.address, []) as raw:
                try:
                    reply = raw.unary_unary(METHOD)(nonce, timeout=_bound(timeout))
                except grpc.RpcError as e:
                    raise _refused(self.address, e) from None
            _check(self.token, self.address, nonce, reply)
            self._proven = True
        finally:
            self._lock.release()


class AioProof:
    """The same for grpc.aio channels (one event loop)."""

    def __init__(self, token: str, address: str):
        self.token, self.address = token, address
        self._lock: asyncio.Lock | None = None
        self._proven = False

    async def ensure(self, timeout: float | None) -> None:
        if self._proven:
            return
        self._lock = self._lock or asyncio.Lock()
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except TimeoutError:
            raise ProofPending(self.address, timeout) from None
        try:
            if self._proven:
                return
            nonce = secrets.token_bytes(NONCE_BYTES)
            async with transport.aio_channel(self.address, []) as raw:
                try:
                    reply = await raw.unary_unary(METHOD)(nonce, timeout=_bound(timeout))
                except grpc.RpcError as e:
                    raise _refused(self.address, e) from None
            _check(self.token, self.address, nonce, reply)
            self._proven = True
        finally:
            self._lock.release()
