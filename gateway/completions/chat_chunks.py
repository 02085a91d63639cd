"""The chat path's streamed answer read back as objects, by the answers that rewrite it
(Anthropic's events, gateway/messages/answer.py; OpenAI's Responses events,
gateway/responses/answer.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


async def chat_chunks(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict | None]:
    """The chat stream's events as objects (None for `[DONE]`), however its bytes are cut."""
    buffer = b""
    async for piece in chunks:
        buffer += piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event.removeprefix(b"data: ")
            yield None if data == b"[DONE]" else json.loads(data)
