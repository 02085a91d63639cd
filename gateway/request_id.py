"""X-Request-Id, as plain ASGI middleware (outermost, so every answer carries it, errors too).

A client (or the load balancer in front) may name its request with an `X-Request-Id` header:
1 to 128 printable ASCII characters without spaces, else 400. The answer carries the same
header: the client's id when it gave one, otherwise the request's own id (the `id` of the
completion, `chatcmpl-...`, which the gateway's and workers' logs use), or a fresh one for
an answer given before the request had an id (a 401, say). The gateway logs a client's id
beside the request's own, so one can be found from the other; the id inside the system
stays the gateway's own (ids must be unique there, a client's need not be).
"""

from __future__ import annotations

import re
import time
import uuid

from fastapi.responses import JSONResponse

from gateway.errors import error_body

HEADER = b"x-request-id"
MAX_LEN = 128
_VALID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LEN)


def client_request_id(request) -> str | None:
    """The client's X-Request-Id of a Starlette request (validated by the middleware), or None."""
    return request.scope.get("state", {}).get("client_request_id")


def arrived_at(request) -> float:
    """When the request reached the gateway (time.monotonic(), set by the middleware)."""
    return request.scope.get("state", {}).get("arrived", time.monotonic())


def set_request_id(request, request_id: str) -> None:
    """The request's own id, for the answer's header when the client gave none."""
    request.scope.setdefault("state", {})["request_id"] = request_id


class RequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope.get("headers") or () if k == HEADER]
        state = scope.setdefault("state", {})
        state["arrived"] = time.monotonic()  # the request's first moment here, for its trace
        if given:
            if len(given) > 1 or not _VALID.fullmatch(given[0]):
                body = error_body(400, f"X-Request-Id must be one value of 1 to {MAX_LEN} printable ASCII "
                                       "characters without spaces", "X-Request-Id")
                await JSONResponse(body, 400, headers={"x-request-id": uuid.uuid4().hex})(scope, receive, send)
                return
            state["client_request_id"] = given[0].decode("ascii")

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                rid = state.get("client_request_id") or state.get("request_id") or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode("ascii"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
