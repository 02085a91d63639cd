"""A streamed chat answer rewritten as the Responses API's events
(gateway/responses/answer.py), from chat chunks made up here: every stream that
began ends in response.completed, .incomplete or .failed; a failed one first closes the
text part and message item it opened and carries the items it sent; a stored answer is
stored before its last event."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.responses.answer import response_events
from gateway.responses.protocol import ResponsesRequest

BODY = ResponsesRequest.model_validate({"model": "smollm2", "input": "Hi", "stream": True})
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1, "model": "smollm2",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def _usage() -> dict:
    return {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1, "model": "smollm2",
            "choices": [], "usage": USAGE}


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _events(chunks: list[dict | None], keep=None) -> list[dict]:
    """The events `chunks` (None: [DONE]) become, their bytes cut in two mid-event as a
    network may cut them."""
    async def chat_stream():
        data = b"".join(b"data: " + (b"[DONE]" if c is None else json.dumps(c).encode()) + b"\n\n" for c in chunks)
        yield data[:len(data) // 2]
        yield data[len(data) // 2:]

    async def read() -> list[dict]:
        return [json.loads(e.split(b"data: ", 1)[1]) async for e in response_events(chat_stream(), BODY, keep)]

    events = asyncio.run(read())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _closed(events: list[dict]) -> None:
    """Every part and item added is done, each once."""
    kinds = [e["type"] for e in events]
    assert kinds.count("response.content_part.added") == kinds.count("response.content_part.done")
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done, kinds


@pytest.mark.parametrize("end", [[_error("the decode worker failed")],  # an error in the stream
                                 [_chunk(finish="abort"), _usage(), None],  # a finish reason that is no ending
                                 []],  # the chat stream just ends
                         ids=["error", "aborted", "cut"])
def test_a_failed_stream_closes_its_message_and_carries_its_text(end):
    events = _events([_chunk({"role": "assistant", "content": "It is "}), _chunk({"content": "sunny"}), *end])
    _closed(events)
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    (message,) = last["response"]["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "It is sunny"
    item_done = [e for e in events if e["type"] == "response.output_item.done"]
    assert item_done[-1]["item"] == message


def test_a_stream_that_fails_after_a_call_carries_the_text_and_the_call():
    events = _events([_chunk({"content": "Checking."}), _chunk({"tool_calls": [CALL]})])
    _closed(events)
    output = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.failed"
    assert [(i["type"], i["status"]) for i in output] == [("message", "completed"), ("function_call", "completed")]
    assert output[1]["call_id"] == "call_1"
    assert [e["type"] for e in events].count("response.output_text.done") == 1  # the message closed once


def test_a_stream_that_ends_before_any_chunk_is_an_error_event():
    (event,) = _events([_error("no decode worker")])
    assert event["type"] == "error" and event["message"] == "no decode worker"
    (event,) = _events([])
    assert event["type"] == "error"


def test_a_finished_stream_is_stored_before_its_last_event():
    kept = []

    async def keep(response: dict) -> None:
        kept.append(response)

    events = _events([_chunk({"content": "Sunny."}), _chunk(finish="stop"), _usage(), None], keep)
    _closed(events)
    assert events[-1]["type"] == "response.completed" and kept == [events[-1]["response"]]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Sunny."
    assert events[-1]["response"]["usage"]["total_tokens"] == 8
