"""A request's answer, from the decode worker's Generate stream to OpenAI's response body.

`generate_events` turns the stream into typed events (each engine step's text, then the
usage; or an error) and records the request's metrics when it ends, however it ends (its
reader may stop at an error, or the client may leave); `sse` frames the events as SSE
chunks when the client streams, `collect` joins them into one JSON object when it does not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from common import trace
from common.tokenizer import Tokenizer
from gateway.errors import APIError
from gateway.completions.logprobs import Logprobs
from gateway.completions.logprobs import render as render_logprobs
from gateway.metrics import (
    COMPLETION_TOKENS,
    E2E,
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    PROMPT_TOKENS,
    REQUESTS,
    SLO,
    SLO_REQUESTS,
    TPOT,
)
from gateway.text_stream import TextStream
from gateway.completions.tools import ToolPlan
from rpc import pdserve_pb2 as pb

_FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort", pb.ERROR: "error"}


@dataclass(frozen=True)
class Text:
    """New text of one engine step (and, on the last, why it ended)."""

    text: str
    finish_reason: str | None
    logprobs: list = field(default_factory=list)
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did


@dataclass(frozen=True)
class ToolCalls:
    """The calls a finished generation made (OpenAI's tool_calls), and any text beside them."""

    calls: list[dict]
    content: str | None


@dataclass(frozen=True)
class Usage:
    usage: dict


@dataclass(frozen=True)
class Failed:
    """The stream broke: the error object OpenAI clients read."""

    error: dict


Event = Text | ToolCalls | Usage | Failed


async def _as_tool_calls(events: AsyncIterator[Event], tools: ToolPlan) -> AsyncIterator[Event]:
    """The text held to its end, then one ToolCalls event if it made calls (else the text
    as one Text event): a call is only a call once it is whole."""
    held: list[str] = []
    async for ev in events:
        if not isinstance(ev, Text):
            yield ev
            continue
        held.append(ev.text)
        if ev.finish_reason is None:
            continue
        text = "".join(held)
        calls, content = tools.calls(text) if ev.finish_reason == "stop" else (None, text)
        yield ToolCalls(calls, content) if calls else Text(text, ev.finish_reason, stop_reason=ev.stop_reason)


async def generate_events(kind, body, rid, call, first, prompt_len, started, first_at, endpoint,
                          tokenizer: Tokenizer, primary: bool = True) -> AsyncIterator[Event]:
    """Each engine step's text as an event; the last carries finish_reason, then the usage.
    `primary`: the choice that records the request's metrics (with n > 1 the others add
    their completion tokens only)."""
    text = TextStream(tokenizer, body.stop or [])
    msg, completion_tokens, status = first, 0, "cancelled"  # until it ends on its own
    try:
        while True:
            completion_tokens += len(msg.token_ids)
            delta = text.push(list(msg.token_ids))
            finish = _FINISH.get(msg.finish_reason)
            if text.stopped:
                finish = "stop"
            elif finish is not None:
                delta += text.finish()
            if msg.error.code != pb.ERROR_NONE:
                status = "error"
                yield Failed({"message": msg.error.message, "type": "server_error", "param": None,
                              "code": pb.ErrorCode.Name(msg.error.code)})
                return
            if delta or finish or msg.logprobs:  # a token whose text is held back still has its logprobs
                yield Text(delta, finish, list(msg.logprobs), text.stop_string)
            if finish is not None:
                status = "ok"
                usage = {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_len + completion_tokens}
                if msg.usage.cached_prompt_tokens:
                    usage["prompt_tokens_details"] = {"cached_tokens": msg.usage.cached_prompt_tokens}
                yield Usage(usage)
                return
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this reader is being cancelled (its client left)
                status = "error"  # the call was, under it (its channel closed): an error, not a client gone
                yield Failed({"message": "decode worker call cancelled mid-stream", "type": "server_error",
                              "param": None, "code": None})
                return
            except grpc.RpcError as e:
                status = "error"
                yield Failed({"message": f"decode worker failed mid-stream ({e.code().name})",
                              "type": "server_error", "param": None, "code": None})
                return
            if msg is grpc.aio.EOF:
                status = "error"
                yield Failed({"message": "decode worker ended the stream early", "type": "server_error",
                              "param": None, "code": None})
                return
    finally:  # however it ends: its own end, an error its reader stopped at, or a client gone
        if primary:
            _record(endpoint, status, started, first_at, prompt_len, completion_tokens)
            trace.event(rid, "finished", status=status, completion_tokens=completion_tokens)
        elif status == "ok":
            COMPLETION_TOKENS.inc(completion_tokens)


def _record(endpoint: str, status: str, started: float, first_at: float, prompt_len: int,
            completion_tokens: int) -> None:
    """The request's outcome: ok, error, or cancelled (the client left before the end: no
    latency is recorded for it)."""
    REQUESTS.labels(endpoint, status).inc()
    if status == "cancelled":
        return
    now = time.monotonic()
    E2E.observe(now - started)
    if status == "ok":  # what the planner reads: the load and its latencies
        PROMPT_TOKENS.inc(prompt_len)
        COMPLETION_TOKENS.inc(completion_tokens)
        PROMPT_LENGTHS.observe(prompt_len)
        OUTPUT_LENGTHS.observe(completion_tokens)
        tpot = (now - first_at) / (completion_tokens - 1) if completion_tokens > 1 else None
        if tpot is not None:
            TPOT.observe(tpot)
        SLO_REQUESTS.labels("yes" if SLO.met(first_at - started, tpot) else "no").inc()


async def sse(kind: str, rid: str, body, choices: list[AsyncIterator[Event]], model_name: str,
              tokenizer: Tokenizer, tools: ToolPlan | None = None) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing: one chunk per event of each choice (its `index`), the usage if
    asked (the prompt counted once), then [DONE]. With tools the text is held to its end
    and sent as `delta.tool_calls` (or as content, if it holds no call)."""
    base = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model_name}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    frames = _TextFrames(kind, base)
    started: set[int] = set()
    usages: list[dict] = []
    if tools is not None:
        choices = [_as_tool_calls(events, tools) for events in choices]
    async with contextlib.aclosing(_interleaved(choices)) as interleaved:  # its readers stop when this does
        async for index, ev in interleaved:
            if isinstance(ev, Failed):
                yield _data({"error": ev.error})
                break
            if isinstance(ev, Usage):
                usages.append(ev.usage)
                if include_usage and len(usages) == len(choices):
                    yield _data({**base, "choices": [], "usage": _total(usages)})
                continue
            first = index not in started
            started.add(index)
            if isinstance(ev, ToolCalls):
                delta = {"role": "assistant", "content": ev.content,
                         "tool_calls": [{"index": i, **call} for i, call in enumerate(ev.calls)]}
                yield _data({**base, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                  "finish_reason": "tool_calls"}]})
                continue
            if not first and ev.finish_reason is None and not ev.logprobs:
                yield frames.text(index, ev.text)  # most events: a step's text, nothing else
                continue
            logprobs = render_logprobs(kind, tokenizer, ev.logprobs)
            if kind == "chat":
                delta = {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": ev.finish_reason}
            else:
                choice = {"index": index, "text": ev.text, "logprobs": logprobs, "finish_reason": ev.finish_reason}
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason  # vLLM's field: the stop string matched, or null
            yield _data({**base, "choices": [choice]})
    yield b"data: [DONE]\n\n"


async def _interleaved(choices: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """(index, event) from every choice as each comes; one choice alone is read directly."""
    if len(choices) == 1:
        async for ev in choices[0]:
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator[Event]) -> None:
        try:
            async for ev in events:
                await queue.put((index, ev))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, ev = await queue.get()
            if ev is None:
                running -= 1
                continue
            yield index, ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _total(usages: list[dict]) -> dict:
    """One request's usage over its choices: the prompt (and its cached part) once."""
    total = dict(usages[0])
    total["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


async def collect_all(kind, choices: list[AsyncIterator[Event]], rid, body, model_name: str, tokenizer: Tokenizer,
                      tools: ToolPlan | None = None) -> dict:
    """Every choice collected (at once), as one response: choices by index, usage totalled."""
    if len(choices) == 1:
        return await collect(kind, choices[0], rid, body, model_name, tokenizer, tools)
    tasks = [asyncio.ensure_future(collect(kind, events, rid, body, model_name, tokenizer, tools))
             for events in choices]
    try:
        answers = await asyncio.gather(*tasks)
    finally:  # one choice failed (or the client left): the others stop reading before anyone closes them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    merged = answers[0]
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    merged["usage"] = _total([a["usage"] for a in answers])
    return merged


async def collect(kind, events: AsyncIterator[Event], rid, body, model_name: str, tokenizer: Tokenizer,
                  tools: ToolPlan | None = None) -> dict:
    """The whole answer as one chat.completion / text_completion object; an error event is a 503.
    Logprobs go into the answer's shape as each step brings them (gateway/completions/logprobs.py)."""
    text, finish, usage, logprobs, calls = [], None, None, Logprobs(kind, tokenizer), None
    stop_reason = None  # the stop string that ended it, if one did
    if tools is not None:
        events = _as_tool_calls(events, tools)
    async for ev in events:
        if isinstance(ev, Failed):
            raise APIError(503, ev.error["message"])
        if isinstance(ev, Usage):
            usage = ev.usage
        elif isinstance(ev, ToolCalls):
            calls, finish = ev.calls, "tool_calls"
            text.append(ev.content or "")
        else:
            text.append(ev.text)
            logprobs.add(ev.logprobs)
            finish = ev.finish_reason or finish
            stop_reason = ev.stop_reason or stop_reason
    content = "".join(text)
    if calls:
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage}
    if kind == "completion" and body.echo and isinstance(body.prompt, str):
        content = body.prompt + content
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs.result(),
               "finish_reason": finish, "stop_reason": stop_reason} if kind == "chat" else
              {"index": 0, "text": content, "logprobs": logprobs.result(), "finish_reason": finish,
               "stop_reason": stop_reason})
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage}


# Characters a model can emit that line readers split on besides \n and \r (Python's
# str.splitlines, which httpx's iter_lines uses): left raw by ensure_ascii=False, they would
# cut an event's JSON in two on the client. JSON structure is ASCII, so they only ever sit
# inside strings, where their escapes mean the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class _TextFrames:
    """The SSE event of a step's text alone (not a choice's first, not its last, no
    logprobs): made by putting the text's JSON between two halves rendered once per choice,
    the same bytes `_data` makes of the whole chunk, at a fraction of the cost per token."""

    _MARK = "\x00"

    def __init__(self, kind: str, base: dict):
        self._kind, self._base = kind, base
        self._halves: dict[int, tuple[bytes, bytes]] = {}

    def text(self, index: int, text: str) -> bytes:
        halves = self._halves.get(index)
        if halves is None:
            if self._kind == "chat":
                choice = {"index": index, "delta": {"content": self._MARK}, "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": index, "text": self._MARK, "logprobs": None, "finish_reason": None}
            head, tail = _data({**self._base, "choices": [choice]}).split(b'"\\u0000"')
            halves = self._halves[index] = (head, tail)
        return halves[0] + json.dumps(text, ensure_ascii=False).translate(_LINE_BREAKS).encode() + halves[1]


def _data(obj: dict) -> bytes:
    """One SSE event: the JSON on a single line, UTF-8, whatever the text holds."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n".encode()
