"""The admin routes on their own listener: 127.0.0.1 and a port of their own.

The gateway serves the OpenAI API to clients on `--host:--port`; `/admin/*` (the deploy
controller's membership push) is served only on a second socket bound to loopback
(`--admin-port`), and the admin socket serves nothing else. A client on the network then
cannot reach the admin routes at all, whatever token it holds; on the gateway's own node
the admin token still guards them. The controller reaches them through the Ray actor that
hosts the gateway on that node (deploy/hosts.py GatewayHost.push_membership).
"""

from __future__ import annotations

import json
import socket

import uvicorn

PREFIX = "/admin/"
HOST = "127.0.0.1"


def bind(port: int) -> socket.socket:
    """The admin socket, listening (port 0: any free one)."""
    return uvicorn.Config(app=None, host=HOST, port=port).bind_socket()


class AdminOnLoopback:
    """ASGI middleware: `/admin/*` only on the admin socket, and only `/admin/*` there; any
    other pairing is a 404, as if the route did not exist."""

    def __init__(self, app, admin_port: int):
        self.app, self.admin_port = app, admin_port

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = scope.get("server") or (None, None)
        on_admin = server[0] == HOST and server[1] == self.admin_port
        if on_admin == scope.get("path", "").startswith(PREFIX):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "not found", "type": "invalid_request_error", "param": None,
                                     "code": "not_found"}}).encode()
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
