"""Slow bodies from one address: connections that send a request head with a Content-Length,
then one body byte every few seconds, more of them than the gateway's per-address cap
(`--max-connections-per-ip`, gateway/front_door/per_ip_cap.py). Past the gateway's short grace they are
stalled and count: those past the cap must get a 429 JSON answer (or be closed) then; those
under it a 408 at the body's whole deadline (gateway/front_door/body_limit.py); and every other address
is served meanwhile."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.chaos.sizes import CLIENT_TIMEOUT_S, MODEL

# An address of the loopback network other than the one every other client uses (Linux
# routes all of 127.0.0.0/8 to lo): the cap counts per address, so the rest stay served.
SLOW_ADDRESS = "127.0.0.2"
BYTE_EVERY_S = 2.0  # well under the gateway's pause bound (--body-timeout): only the whole deadline ends it


@dataclass
class SlowBodies:
    """How the slow bodies ended: "429", "408", "closed", "held open" (no end within the
    client timeout) or the first bytes of anything else; the cap the 429s named; when the
    last one ended."""

    endings: Counter = field(default_factory=Counter)
    cap: int | None = None  # "(limit N)" of a 429's message
    non_json_429: int = 0
    seconds: list[float] = field(default_factory=list)  # each 408's time from its head

    def problems(self, sent: int) -> list[str]:
        """What the issue forbids, `sent` slow bodies having been sent: any other ending, a
        429 that is not JSON or names no cap, and other than exactly the cap's worth held
        until their deadline (408) with the rest refused at once."""
        out = [f"a slow body -> {what} (x {n})" for what, n in self.endings.items()
               if what not in ("429", "408", "closed")]
        if self.non_json_429:
            out.append(f"{self.non_json_429} x 429 without a JSON error naming the cap")
        if self.cap is None:
            out.append(f"none of {sent} slow bodies from one address got a 429 naming the per-address cap")
        elif self.endings["408"] != min(sent, self.cap):
            out.append(f"{self.endings['408']} of {sent} slow bodies got 408 at their deadline; the cap is {self.cap}")
        return out


async def slow_bodies(url: str, api_key: str, connections: int) -> SlowBodies:
    """`connections` slow bodies at once from SLOW_ADDRESS; returns once each has ended."""
    out = SlowBodies()
    ends = await asyncio.gather(*(_one(url, api_key) for _ in range(connections)))
    for what, answer, seconds in ends:
        out.endings[what] += 1
        if what == "429":
            cap = re.search(rb"\(limit (\d+)\)", answer)
            out.cap = int(cap.group(1)) if cap else out.cap
            out.non_json_429 += cap is None or b"application/json" not in answer.lower() or b'"error"' not in answer
        if what == "408":
            out.seconds.append(seconds)
    return out


async def _one(url: str, api_key: str) -> tuple[str, bytes, float]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x" * 64, "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(SLOW_ADDRESS, 0))
    except OSError as e:
        return f"connect failed: {e}", b"", 0.0
    try:
        writer.write(head)
        sent = 0
        while time.monotonic() - t0 < CLIENT_TIMEOUT_S:
            try:
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(4096), BYTE_EVERY_S)
            except asyncio.TimeoutError:
                if sent < len(body) - 1:  # never the whole body: its deadline comes first
                    writer.write(body[sent:sent + 1])
                    sent += 1
                continue
            if not answer:
                return "closed", b"", time.monotonic() - t0
            seconds = time.monotonic() - t0
            answer += await _rest(reader)
            status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else repr(answer[:12])
            return status, answer, seconds
        return "held open", b"", time.monotonic() - t0
    except OSError:  # reset: refused without an answer
        return "closed", b"", time.monotonic() - t0
    finally:
        writer.close()


async def _rest(reader: asyncio.StreamReader) -> bytes:
    """What more of the answer arrives within a second (its body, if not in the first read)."""
    rest = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(4096), 1.0):
            rest += chunk
    except (asyncio.TimeoutError, OSError):
        pass
    return rest
