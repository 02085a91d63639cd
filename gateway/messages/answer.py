"""The chat path's answer as Anthropic's: a `message` object, or its stream of events.

    answer = messages_answer(chat_answer, prompt_tokens)   # the Response gateway/request_path.py returned

A whole chat.completion becomes one message, its id the chat request's (what the logs,
`pdserve trace` and X-Request-Id name): its text a `text` block, each tool call a
`tool_use` block (its arguments parsed as the `input`), the finish reason a `stop_reason`
(stop -> end_turn, or stop_sequence with the `stop_sequence` that matched, which the chat
path names in its choice's `stop_reason`; length -> max_tokens; tool_calls -> tool_use)
and the usage Anthropic's
(`input_tokens` the prompt's uncached part, `cache_read_input_tokens` the cached one).

A streamed answer keeps its response (so the chat path's ending of it, the client leaving
included, is untouched) and gets its chunks rewritten as Anthropic's events, in order:
`message_start`; per block `content_block_start`, `content_block_delta` (`text_delta`, or
for a call its arguments as one `input_json_delta`) and `content_block_stop`, with a `ping`
after the first start; then `message_delta` (`stop_reason` and the usage) and
`message_stop`. A failure mid-stream is an `error` event, as Anthropic sends one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.completions.chat_chunks import chat_chunks
from gateway.errors import APIError
from gateway.served import served_headers

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def messages_answer(chat_answer: Response, prompt_tokens: int) -> Response:
    """Anthropic's answer in place of the chat path's: streamed, whole, or (a client that
    left: nobody reads it) as it is. `prompt_tokens`: what `message_start` counts as input
    (the whole prompt; `message_delta` then splits off what was cached)."""
    if isinstance(chat_answer, StreamingResponse):
        chat_answer.body_iterator = message_events(chat_answer.body_iterator, prompt_tokens)
        return chat_answer
    if chat_answer.status_code != 200:
        return chat_answer
    return JSONResponse(message_of(json.loads(chat_answer.body)), headers=served_headers(chat_answer.headers))


def message_of(completion: dict) -> dict:
    """A chat.completion as an Anthropic message; APIError 503 for a generation that did not
    end (aborted on its worker)."""
    choice = completion["choices"][0]
    content = []
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    content += [_tool_use(call) for call in choice["message"].get("tool_calls") or []]
    return {"id": completion["id"], "type": "message", "role": "assistant", "model": completion["model"],
            "content": content, **_stop(choice), "usage": _usage(completion["usage"])}


def _stop(choice: dict) -> dict:
    """A finished chat choice's `stop_reason` and `stop_sequence`, as Anthropic's message says them."""
    if choice["finish_reason"] not in _STOP_REASONS:
        raise APIError(503, _unfinished(choice["finish_reason"]))
    sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    return {"stop_reason": "stop_sequence" if sequence is not None else _STOP_REASONS[choice["finish_reason"]],
            "stop_sequence": sequence}


def _unfinished(finish_reason: str | None) -> str:
    """Why an answer has no stop_reason: its worker aborted or failed it."""
    return f"the generation ended without finishing ({finish_reason})"


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def _usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "output_tokens": usage["completion_tokens"]}


async def message_events(chunks: AsyncIterator[bytes], prompt_tokens: int) -> AsyncIterator[bytes]:
    """A streamed chat answer's SSE chunks (its usage included) as Anthropic's SSE events.
    Closing this closes the chat answer's stream."""
    blocks = _Blocks()
    stop = usage = None
    async with contextlib.aclosing(chunks), contextlib.aclosing(chat_chunks(chunks)) as parsed:
        async for chunk in parsed:
            if chunk is None:  # [DONE]
                break
            if "error" in chunk:
                yield _error(chunk["error"]["message"])
                return
            if not blocks.started:
                yield _event("message_start", {"type": "message_start", "message": {
                    "id": chunk["id"], "type": "message", "role": "assistant", "model": chunk["model"], "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
                blocks.started = True
            if not chunk["choices"]:
                usage = chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            for event in blocks.text(choice["delta"].get("content") or ""):
                yield event
            for call in choice["delta"].get("tool_calls") or ():
                for event in blocks.tool_use(call):
                    yield event
            if choice["finish_reason"] is not None:
                if choice["finish_reason"] not in _STOP_REASONS:
                    yield _error(_unfinished(choice["finish_reason"]))
                    return
                stop = _stop(choice)
    if stop is None or usage is None:  # the chat stream ended early: nothing more to say
        return
    for event in blocks.close():
        yield event
    yield _event("message_delta", {"type": "message_delta", "delta": stop, "usage": _usage(usage)})
    yield _event("message_stop", {"type": "message_stop"})


class _Blocks:
    """The content blocks of a streamed message, numbered as they open."""

    def __init__(self):
        self.started = False  # message_start sent
        self._count = 0
        self._text_open = False

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = [] if self._text_open else self._open({"type": "text", "text": ""})
        self._text_open = True
        return events + [self._delta({"type": "text_delta", "text": text})]

    def tool_use(self, call: dict) -> list[bytes]:
        """A whole call: the chat path sends each one complete."""
        events = self.close() + self._open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                            "input": {}})
        return events + [self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                         self._stop()]

    def close(self) -> list[bytes]:
        """The open text block's end, if one is open."""
        if not self._text_open:
            return []
        self._text_open = False
        return [self._stop()]

    def _open(self, block: dict) -> list[bytes]:
        self._count += 1
        start = _event("content_block_start", {"type": "content_block_start", "index": self._count - 1,
                                               "content_block": block})
        return [start, _event("ping", {"type": "ping"})] if self._count == 1 else [start]

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self._count - 1,
                                              "delta": delta})

    def _stop(self) -> bytes:
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._count - 1})


def _error(message: str) -> bytes:
    """A failure mid-stream, as Anthropic's `error` event (a 500's api_error)."""
    return _event("error", {"type": "error", "error": {"type": "api_error", "message": message}})


def _event(name: str, data: dict) -> bytes:
    """One SSE event of Anthropic's: its name, then its JSON on one line (ASCII: no character
    a line reader splits on is left raw)."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
