"""The chat path's answer as a Responses API `response`, or its stream of typed events.

    answer = await responses_answer(chat_answer, body, keep)   # the Response gateway/request_path.py returned

A whole chat.completion becomes one response, its id the chat request's (what the logs,
`pdserve trace` and X-Request-Id name): its text one `message` output item (one
`output_text` part), each tool call a `function_call` item after it (`call_id` the call's
id), the finish reason its `status` (stop, tool_calls -> completed; length -> incomplete,
with `incomplete_details.reason` max_output_tokens) and the usage OpenAI's (`input_tokens`
the whole prompt, its cached part in `input_tokens_details`). An answer with neither text
nor calls still has its message, with empty text. The request's settings are echoed as
OpenAI's response does (instructions, tools, tool_choice, text, temperature, ...).

Either way the answer keeps the chat answer's x-pdserve-* headers (how it was served:
gateway/served.py). A streamed answer keeps its response (so the chat path's ending of it, the client leaving
included, is untouched) and gets its chunks rewritten as OpenAI's events, each with a
`sequence_number` counting from 0: `response.created`, `response.in_progress`; for the text
`response.output_item.added`, `response.content_part.added`, a `response.output_text.delta`
per chunk, then `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; for each call `response.output_item.added`,
`response.function_call_arguments.delta` (the whole arguments: the chat path sends each call
whole) and `.done`, `response.output_item.done`; last `response.completed` (or
`response.incomplete`) with the whole response. A failure mid-stream (an error, a finish
reason that is none of those, or a chat stream that ends before its finish reason and
usage) is `response.failed`, after the open text part and message item are done (status
`incomplete`), its `output` the items sent so far; OpenAI's `error` event before
`response.created`. So every stream that began ends in one of the three.

`await keep(response)`, when given, stores a finished response (completed or incomplete)
before it is sent: the store's (gateway/responses/store.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.completions.chat_chunks import chat_chunks
from gateway.errors import APIError
from gateway.responses.protocol import NamedFunction, ResponsesRequest
from gateway.responses.store import Keep
from gateway.served import served_headers

_FINISHED = ("stop", "length", "tool_calls")


async def responses_answer(chat_answer: Response, body: ResponsesRequest, keep: Keep | None = None) -> Response:
    """OpenAI's response in place of the chat path's: streamed, whole, or (an error, or a
    client that left: nobody reads it) as it is."""
    if isinstance(chat_answer, StreamingResponse):
        chat_answer.body_iterator = response_events(chat_answer.body_iterator, body, keep)
        return chat_answer
    if chat_answer.status_code != 200:
        return chat_answer
    completion = json.loads(chat_answer.body)
    choice = completion["choices"][0]
    if choice["finish_reason"] not in _FINISHED:
        raise APIError(503, _unfinished(choice["finish_reason"]))
    response = finished(envelope(body, completion["id"], completion["created"]), choice["message"].get("content"),
                        choice["message"].get("tool_calls") or [], choice["finish_reason"], completion["usage"])
    if keep is not None:
        await keep(response)
    return JSONResponse(response, headers=served_headers(chat_answer.headers))


def envelope(body: ResponsesRequest, rid: str, created_at: int) -> dict:
    """A response before it has output: its id, and the request's settings echoed."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
    return {"id": rid, "object": "response", "created_at": created_at, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature, "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice or "auto", "tools": [t.model_dump() for t in body.tools or ()],
            "top_p": body.top_p, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}}


def finished(base: dict, text: str | None, calls: list[dict], finish_reason: str, usage: dict) -> dict:
    """`base` with its output and usage, as the generation ended."""
    cut = finish_reason == "length"
    output = [_message(base["id"], text or "", "incomplete" if cut else "completed")] if text or not calls else []
    output += [_function_call(base["id"], i, call) for i, call in enumerate(calls)]
    return {**base, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output, "usage": _usage(usage)}


def _message(rid: str, text: str | None, status: str) -> dict:
    """The message item (`text` None: as it opens, before any part)."""
    content = [] if text is None else [_text_part(text)]
    return {"id": f"msg_{_hex(rid)}", "type": "message", "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(rid: str, index: int, call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    return {"id": f"fc_{_hex(rid)}_{index}", "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments}


def _hex(rid: str) -> str:
    """The unique part of a request id (`chatcmpl-<hex>`), for its items' ids."""
    return rid.rpartition("-")[2]


def _usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _unfinished(finish_reason: str | None) -> str:
    """Why an answer has no status: its worker aborted or failed it."""
    return f"the generation ended without finishing ({finish_reason})"


async def response_events(chunks: AsyncIterator[bytes], body: ResponsesRequest, keep: Keep | None = None
                          ) -> AsyncIterator[bytes]:
    """A streamed chat answer's SSE chunks (its usage included) as OpenAI's Responses events.
    Closing this closes the chat answer's stream."""
    events = _Events()
    base = None
    text, calls, finish, usage = None, [], None, None  # text: None until the message item opens
    message_open = False  # its part and item are added and not yet done
    failure = "the answer's stream ended before it finished"  # unless it finishes
    async with contextlib.aclosing(chunks), contextlib.aclosing(chat_chunks(chunks)) as parsed:
        async for chunk in parsed:
            if chunk is None:  # [DONE]
                break
            if "error" in chunk:
                failure = chunk["error"]["message"]
                break
            if base is None:
                base = envelope(body, chunk["id"], chunk["created"])
                yield events.emit("response.created", response=base)
                yield events.emit("response.in_progress", response=base)
            if not chunk["choices"]:
                usage = chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            delta = choice["delta"].get("content") or ""
            if delta:
                if text is None:
                    text, message_open = "", True
                    for event in events.open_message(base["id"]):
                        yield event
                text += delta
                yield events.emit("response.output_text.delta", item_id=f"msg_{_hex(base['id'])}", output_index=0,
                                  content_index=0, delta=delta, logprobs=[])
            for call in choice["delta"].get("tool_calls") or ():
                if message_open:  # the text before the calls ends where they begin
                    message_open = False
                    for event in events.close_message(base["id"], text, "completed"):
                        yield event
                for event in events.function_call(base["id"], len(calls), call, 0 if text is None else 1):
                    yield event
                calls.append(call)
            if choice["finish_reason"] is not None:
                if choice["finish_reason"] not in _FINISHED:
                    failure = _unfinished(choice["finish_reason"])
                    break
                finish = choice["finish_reason"]
    if finish is None or usage is None:  # failed, or the chat stream ended early: what was sent ends, failed
        if message_open:
            for event in events.close_message(base["id"], text, "incomplete"):
                yield event
        yield events.failed(base, failure, _partial_output(base, text, calls))
        return
    if not calls:  # the message ends with the response (an empty one if no text came)
        if text is None:
            text = ""
            for event in events.open_message(base["id"]):
                yield event
        for event in events.close_message(base["id"], text, "incomplete" if finish == "length" else "completed"):
            yield event
    response = finished(base, text, calls, finish, usage)
    if keep is not None:
        await keep(response)  # stored before the client hears it is finished, so it may chain to it at once
    yield events.emit("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                      response=response)


def _partial_output(base: dict | None, text: str | None, calls: list[dict]) -> list[dict]:
    """The items a failed stream sent, as they ended: its message if it opened (completed
    where the calls after it closed it, else incomplete), and the calls that came whole."""
    if base is None:
        return []
    output = [] if text is None else [_message(base["id"], text, "completed" if calls else "incomplete")]
    return output + [_function_call(base["id"], i, call) for i, call in enumerate(calls)]


class _Events:
    """The response's events, numbered as they are sent."""

    def __init__(self):
        self._numbers = itertools.count()

    def emit(self, kind: str, **data) -> bytes:
        """One SSE event: its name, then its JSON (its type and sequence number first) on one
        line (ASCII: no character a line reader splits on is left raw)."""
        event = {"type": kind, "sequence_number": next(self._numbers), **data}
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()

    def open_message(self, rid: str) -> list[bytes]:
        item_id = f"msg_{_hex(rid)}"
        return [self.emit("response.output_item.added", output_index=0, item=_message(rid, None, "in_progress")),
                self.emit("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                          part=_text_part(""))]

    def close_message(self, rid: str, text: str, status: str) -> list[bytes]:
        item_id = f"msg_{_hex(rid)}"
        return [self.emit("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                          logprobs=[]),
                self.emit("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                          part=_text_part(text)),
                self.emit("response.output_item.done", output_index=0, item=_message(rid, text, status))]

    def function_call(self, rid: str, index: int, call: dict, first_index: int) -> list[bytes]:
        """A whole call's events; `first_index`: the output index of the first call."""
        item = _function_call(rid, index, call)
        at = first_index + index
        return [self.emit("response.output_item.added", output_index=at,
                          item=_function_call(rid, index, call, arguments="", status="in_progress")),
                self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                          delta=item["arguments"]),
                self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                          arguments=item["arguments"]),
                self.emit("response.output_item.done", output_index=at, item=item)]

    def failed(self, base: dict | None, message: str, output: list[dict]) -> bytes:
        """A failure mid-stream, as OpenAI's `response.failed` (a server error) with the
        items sent so far; OpenAI's `error` event if it came before the response was created."""
        if base is None:
            return self.emit("error", code="server_error", message=message, param=None)
        return self.emit("response.failed", response={**base, "status": "failed", "output": output,
                                                      "error": {"code": "server_error", "message": message}})
