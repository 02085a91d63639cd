"""Notifications that travel with (or beside) KV writes, versioned like the handshake.

`pdkv/1 done <id> <num_blocks>` rides on the last write of a request (`<id>`: the attempt's
transfer id, else the request id): NIXL delivers
it only after that write's data has landed, and the sender posts that write only after
every earlier chunk completed, so it means "all blocks are in". `pdkv/1 abort
<request_id>` is a standalone notification sent once nothing of the request is in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

_PREFIX = "pdkv/1"


class NotifKind(enum.Enum):
    DONE = "done"
    ABORT = "abort"


@dataclass(frozen=True)
class Notification:
    sender: str  # agent name of the writer
    kind: NotifKind
    request_id: str
    num_blocks: int = 0


def encode(kind: NotifKind, request_id: str, num_blocks: int = 0) -> bytes:
    if " " in request_id or not request_id:
        raise ValueError(f"request id {request_id!r}: must be non-empty without spaces")
    return f"{_PREFIX} {kind.value} {request_id} {num_blocks}".encode()


def decode(sender: str, message: bytes) -> Notification | None:
    """The notification in `message`, or None for anything that is not ours."""
    try:
        prefix, kind, request_id, num_blocks = message.decode().split(" ")
        if prefix != _PREFIX:
            return None
        return Notification(sender, NotifKind(kind), request_id, int(num_blocks))
    except (UnicodeDecodeError, ValueError):
        return None
