"""A Messages request as the chat request it means: one path through the gateway.

    chat = chat_request(body, template_renders_tools)   # a ChatCompletionRequest, served like any other

So tenants, admission, limits, routing, cancellation, metrics and traces are the chat
path's own (gateway/request_path.py). What maps:

- `system` -> a system message first; a user message's text -> a user message; an
  assistant's text and `tool_use` blocks -> an assistant message with `tool_calls` (the
  input as JSON arguments, the block's id as the call's); each `tool_result` -> a tool
  message answering its call (an error result says "Error: " first), in the order the
  blocks came;
- `tools` -> functions (`input_schema` their parameters, `strict` theirs); `tool_choice` auto / any / tool
  / none -> "auto" / "required" / the named function / "none", and
  `disable_parallel_tool_use` -> `parallel_tool_calls` false;
- `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences` (-> `stop`), `stream`
  (with the usage, which `message_delta` carries), `metadata.user_id` (-> `user`).

A conversation that ends on the assistant's turn (Anthropic's prefill, continuing that
message) is a 400: the chat template opens a new turn.
"""

from __future__ import annotations

import json

from gateway.errors import APIError
from gateway.messages.protocol import (
    MessagesRequest,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.completions.protocol import ChatCompletionRequest, ChatMessage, StreamOptions
from gateway.completions.tools import FunctionSpec, NamedFunction, NamedToolChoice, Tool
from gateway.completions.tools import ToolChoice as ChatToolChoice


def chat_request(body: MessagesRequest, template_renders_tools: bool) -> ChatCompletionRequest:
    """The chat request `body` means; APIError 400 naming what cannot be served (in the
    Messages API's words where the chat path's would name its own)."""
    if body.messages[-1].role != "user":
        raise APIError(400, "messages: the last message must be the user's (continuing an assistant message is "
                            "not supported)", "messages")
    if body.tools and (body.tool_choice is None or isinstance(body.tool_choice, ToolChoiceAuto)) \
            and not template_renders_tools:
        raise APIError(400, 'tool_choice "auto" (the default with tools) needs a chat template that shows the model '
                            'its tools, and this model\'s does not: use {"type": "any"}, {"type": "tool", "name": ...} '
                            'or {"type": "none"}', "tool_choice")
    system = [ChatMessage(role="system", content="".join(b.text for b in body.system))] if body.system else []
    return ChatCompletionRequest(
        model=body.model, messages=system + _chat_messages(body), max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences or None,
        stream=body.stream, stream_options=StreamOptions(include_usage=True) if body.stream else None,
        user=body.metadata.user_id if body.metadata else None,
        tools=[Tool(type="function", function=FunctionSpec(name=t.name, description=t.description,
                                                           parameters=t.input_schema, strict=t.strict))
               for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=False if getattr(body.tool_choice, "disable_parallel_tool_use", False) else None)


def _chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, message in enumerate(body.messages):
        if message.role == "assistant":
            text, calls = [], []
            for j, block in enumerate(message.content):
                if isinstance(block, ToolResultBlock):
                    raise APIError(400, f"messages.{i}.content.{j}: a tool_result belongs in a user message",
                                   f"messages.{i}.content.{j}")
                if isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name,
                                               "arguments": json.dumps(block.input, ensure_ascii=False)}})
                else:
                    text.append(block.text)
            out.append(ChatMessage(role="assistant", content="".join(text), tool_calls=calls or None))
            continue
        text, emitted = [], False
        for j, block in enumerate(message.content):
            if isinstance(block, ToolUseBlock):
                raise APIError(400, f"messages.{i}.content.{j}: a tool_use belongs in an assistant message",
                               f"messages.{i}.content.{j}")
            if isinstance(block, ToolResultBlock):
                if text:  # text before a result stays before it
                    out.append(ChatMessage(role="user", content="".join(text)))
                    text = []
                out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text()))
                emitted = True
            else:
                text.append(block.text)
        if text or not emitted:
            out.append(ChatMessage(role="user", content="".join(text)))
    return out


def _tool_choice(choice: ToolChoice | None) -> ChatToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceAuto):
        return "auto"
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if isinstance(choice, ToolChoiceTool):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return "none"
