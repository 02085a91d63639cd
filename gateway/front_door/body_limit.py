"""The front door, as plain ASGI middleware: authenticate, then bound the body as it arrives.

Plain ASGI, not @app.middleware: Starlette's BaseHTTPMiddleware hides client disconnects
from the endpoint (Request.is_disconnected).

- A POST to the API (`/v1/...`) is authenticated from its headers (`Authorization: Bearer`
  or `x-api-key`) before a byte of its body is read (401 at once; an open gateway lets
  everyone in).
- A body declared over the limit (`Content-Length`) gets 413 at once; a body without one
  (chunked transfer encoding) is counted as it arrives, and 413 comes as soon as the count
  passes the limit, so no body larger than the limit is ever held or parsed.
- A client that stops sending its body for `body_timeout_s` gets 408 and its connection
  back: half-sent requests do not hold the gateway's connections open. So does one whose
  whole body takes longer than `body_timeout_s` plus the size limit at MIN_BODY_BYTES_PER_S
  (a client sending a byte now and then would otherwise hold a connection for as long as
  it likes, and enough of them every `--max-connections` slot).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from gateway.errors import APIError, error_body


# The slowest a body may arrive on the whole: a slow mobile link sends far faster.
MIN_BODY_BYTES_PER_S = 16 * 1024


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float, in_all: bool = False):
        super().__init__(408, f"request body not received within {seconds:g}s{' in all' if in_all else ''}")


class BodyTooLarge(HTTPException):
    """Raised from `receive` past the limit; FastAPI re-raises HTTPExceptions from body reads."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body over {max_bytes} bytes")


class BodyLimit:
    def __init__(self, app, max_bytes: int, authenticate: Callable[[str | None, str | None], object] | None = None,
                 body_timeout_s: float = 30.0):
        self.app, self.max_bytes, self.authenticate = app, max_bytes, authenticate
        self.body_timeout_s = body_timeout_s
        # the whole body's bound: a pause's, plus the largest body at the slowest rate allowed
        self.body_deadline_s = body_timeout_s + max_bytes / MIN_BODY_BYTES_PER_S

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if self.authenticate is not None and scope.get("method") == "POST" and scope.get("path", "").startswith("/v1/"):
            try:
                self.authenticate(headers.get(b"authorization", b"").decode("latin-1") or None,
                                  headers.get(b"x-api-key", b"").decode("latin-1") or None)
            except APIError as e:
                await JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status)(scope, receive, send)
                return
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0
        started = False
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.body_deadline_s

        async def counted_receive():
            nonlocal received, body_done
            if body_done:  # later receives wait for the client to leave (streaming): no timeout
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.body_timeout_s, left)))
            except TimeoutError:
                if left < self.body_timeout_s:
                    raise BodyTimeout(self.body_deadline_s, in_all=True) from None
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        async def watched_send(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except (BodyTooLarge, BodyTimeout) as e:  # read outside FastAPI's body parsing (nothing answered it)
            if not started:
                await JSONResponse(error_body(e.status_code, e.detail), e.status_code)(scope, receive, send)

    async def _too_large(self, scope, receive, send) -> None:
        await JSONResponse(error_body(413, f"request body over {self.max_bytes} bytes"), 413)(scope, receive, send)
