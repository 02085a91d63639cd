"""The request-body size limit, as plain ASGI middleware."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class BodyLimit:
    """413 for a declared body over the limit. Plain ASGI, not @app.middleware: Starlette's
    BaseHTTPMiddleware hides client disconnects from the endpoint (Request.is_disconnected)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = dict(scope.get("headers") or ()).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.max_bytes:
                body = {"error": {"message": f"request body over {self.max_bytes} bytes",
                                  "type": "invalid_request_error", "param": None, "code": None}}
                await JSONResponse(body, 413)(scope, receive, send)
                return
        await self.app(scope, receive, send)
