"""Errors on `/v1/messages` in Anthropic's shape, as plain ASGI middleware.

Every refusal of a Messages request (a missing key, a body too large or too slow, a bad
field, a tenant at its limit, no worker) is made where the chat API's is, in OpenAI's shape
(gateway/errors.py); on its way out this rewrites it as Anthropic's, keeping the status:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

Only answers with an error status are held (to rewrite them); a streamed answer passes
through as it is written.
"""

from __future__ import annotations

import json

PATH = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error object for an answer with HTTP `status`."""
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        held: dict | None = None  # an error answer's start, until its body is whole
        body = b""

        async def rewriting_send(message):
            nonlocal held, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = _rewritten(held["status"], body)
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            await send({**held, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def _rewritten(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's; any other body as it is."""
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return body
    return json.dumps(anthropic_error(status, message)).encode()
