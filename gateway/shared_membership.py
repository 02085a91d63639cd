"""The deploy controller's membership push, shared by the processes of one gateway.

With `--processes N` the admin socket is shared like the client one, so a
`PUT /admin/workers` reaches one process. That process answers it as a lone gateway would
(gateway/app.py) and then writes its body to the shared folder: a temporary file renamed
over `membership.json`, so a reader sees the old push or the new one, whole. Every process
looks at the file every `interval_s` (100 ms) and replays a push it has not seen to itself,
as the same PUT through its own app, so routing, `GET /admin/workers`, `/ready` and the
controller's series in `/metrics` agree in every process within about that long. A process
started after the push (a restarted one) replays the file as it starts.

A push is known by its file's inode and mtime, not the mtime alone: each rename installs a
new inode, so two pushes that land in one clock tick still differ, and a process that wrote
a push knows it as its own and does not replay it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from gateway.front_door.admin_listener import HOST

log = logging.getLogger(__name__)

ROUTE = "/admin/workers"


class SharedMembership:
    """ASGI middleware around a gateway process's app: records the membership pushes it
    answers 200 and replays the ones the other processes answered."""

    def __init__(self, app, path: Path, admin_port: int, admin_token: str, interval_s: float = 0.1):
        self.app, self.path, self.admin_port, self.interval_s = app, Path(path), admin_port, interval_s
        self._token = admin_token
        self._seen: tuple[int, int] | None = None  # (inode, mtime_ns) of the push this process has

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # the whole life of the server: follow the file meanwhile
            task = asyncio.create_task(self._follow())
            try:
                await self.app(scope, receive, send)
            finally:
                task.cancel()
            return
        if not (scope["type"] == "http" and scope.get("method") == "PUT" and scope.get("path") == ROUTE
                and tuple(scope.get("server") or ()) == (HOST, self.admin_port)):
            await self.app(scope, receive, send)
            return
        body, status = bytearray(), []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        if status == [200]:
            self._publish(bytes(body))

    def _publish(self, body: bytes) -> None:
        """`body` as the shared push, known to this process as its own."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._seen = (st.st_ino, st.st_mtime_ns)

    async def _follow(self) -> None:
        while True:
            try:
                await self._replay_if_new()
            except Exception:  # never let the loop die; the next look tries again
                log.exception("following the shared membership push failed")
            await asyncio.sleep(self.interval_s)

    async def _replay_if_new(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:  # no push yet
            return
        try:  # identity and content from one open file: a rename meanwhile is seen next time
            st = os.fstat(fd)
            if (st.st_ino, st.st_mtime_ns) == self._seen:
                return
            body = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
        finally:
            os.close(fd)
        self._seen = (st.st_ino, st.st_mtime_ns)
        status = await self._replay(body)
        if status != 200:
            log.warning("a membership push another gateway process took got %s here", status)

    async def _replay(self, body: bytes) -> int | None:
        """`body` as a PUT to this process's own app, on its admin socket, with the token."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "PUT", "scheme": "http", "path": ROUTE, "raw_path": ROUTE.encode(), "root_path": "",
                 "query_string": b"", "server": (HOST, self.admin_port), "client": (HOST, 0), "state": {},
                 "headers": [(b"authorization", f"Bearer {self._token}".encode()),
                             (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        status: list[int] = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await self.app(scope, receive, send)
        return status[0] if status else None
