"""Many SSE streams at once over raw sockets, cheap enough that a thousand share one loop
beside the system they load: a minimal HTTP/1.1 client per connection that timestamps each
read and counts its `data:` events (bench/stream_path.py, and the gateway's burst test)."""

from __future__ import annotations

import asyncio
import json
import time


class Stream(asyncio.Protocol):
    """One streaming request on its own connection, read as the loop hands over each read
    (a protocol: no task per stream, no await per read). It keeps the time of each read that
    brought tokens and how many: every SSE `data:` line but [DONE] is one token (the ids the
    worker cycles through each detokenize to text, so each token is one event)."""

    _EVENT = b"\ndata: "  # every event starts a line (after the head, or a chunk's size line)
    _DONE = b"\ndata: [DONE]"

    def __init__(self, request: bytes):
        self.request = request
        self.times: list[float] = []
        self.counts: list[int] = []
        self.done = False
        self.error = ""
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._head: bytes | None = b""  # until the response head is in
        self._tail = b""  # the last bytes read: an event marker may span two reads

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()  # the host's one monotonic clock, the worker's step times' too
        if self._head is not None:
            self._head += data
            head, sep, data = self._head.partition(b"\r\n\r\n")
            if not sep:
                return
            self._head = None
            if not head.startswith(b"HTTP/1.1 200"):
                self.error = (head.split(b"\r\n", 1)[0] + b": " + data).decode(errors="replace")[:300]
                return
            data = b"\n" + data
        seen = self._tail + data
        n = seen.count(self._EVENT, max(0, len(self._tail) - len(self._EVENT) + 1))  # none counted twice
        if not self.done and self._DONE in seen:
            self.done, n = True, n - 1
        self._tail = seen[-len(self._DONE) + 1:]
        if n:
            self.times.append(now)
            self.counts.append(n)

    def connection_lost(self, exc) -> None:
        if not self.done and not self.error:
            self.error = f"the stream ended before [DONE] ({exc!r})"
        self.ended.set_result(None)


async def open_streams(url: str, n: int, path: str, body: dict, local_address: str | None = None) -> list[Stream]:
    """`n` streaming POSTs of `body` to `path`, every connection opened at once from one
    address (`local_address`, else the system's pick), each read to its end; the streams,
    once all ended. A connection refused or reset is a Stream with its `error` set."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data
    loop = asyncio.get_running_loop()
    streams = [Stream(request) for _ in range(n)]

    async def run(s: Stream) -> None:
        try:
            transport, _ = await loop.create_connection(
                lambda: s, host, int(port), local_addr=(local_address, 0) if local_address else None)
        except OSError as e:
            s.error = f"connect: {e!r}"
            return
        try:
            await s.ended
        finally:
            transport.close()

    await asyncio.gather(*(run(s) for s in streams))
    return streams
