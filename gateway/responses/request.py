"""A Responses request as the chat request it means: one path through the gateway.

    chat, conversation = chat_request(body, history)   # a ChatCompletionRequest, served like any other

So tenants, admission, limits, routing, cancellation, metrics and traces are the chat
path's own (gateway/request_path.py). What maps:

- `instructions` -> a system message first (not kept with the conversation: a later
  response chained to this one has only its own, as OpenAI's do);
- `history` (the stored conversation `previous_response_id` names), then `input`: a string
  is one user message; a message item keeps its role (user, system, developer, assistant)
  and its text parts joined; `function_call` items join the assistant message before them
  as its `tool_calls` (the `call_id` the call's id), and each `function_call_output` is a
  tool message answering its call;
- `tools` -> functions (`parameters`, `strict`: true unless said otherwise, as OpenAI's
  default); `tool_choice` and `parallel_tool_calls` as they are, a named function as the
  chat API names one;
- `text.format` -> `response_format` (json_object, or json_schema and its `strict`);
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `seed`, `user`; `stream`
  (with the usage, which `response.completed` carries).

`conversation` is `history` and the input's messages: what a stored answer keeps, with its
output items after them (gateway/responses/store.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import ValidationError

from gateway.errors import APIError
from gateway.responses.protocol import (
    BuiltInTool,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Message,
    NamedFunction,
    ResponsesRequest,
)
from gateway.completions.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
)
from gateway.completions.tools import FunctionSpec, NamedToolChoice, Tool
from gateway.completions.tools import NamedFunction as ChatNamedFunction

# The chat path's parameter names where the Responses API has its own: an error the chat
# request or path raises is said in the Responses API's words (responses_name).
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
# A leading chat parameter name in an error's message (`messages.3.content: ...`).
_LEADING_NAME = re.compile(r"^[A-Za-z_]+(?:\.[A-Za-z0-9_]+)*")


def chat_request(body: ResponsesRequest, history: Sequence[ChatMessage]) -> tuple[ChatCompletionRequest,
                                                                                  list[ChatMessage]]:
    """The chat request `body` means after `history`, and the conversation it continues
    (history and input); APIError 400 naming what cannot be served."""
    _refuse_unserved(body)
    conversation = [*history, *item_messages(body.input)]
    if not conversation:
        raise APIError(400, "input: give at least one item (or a previous_response_id)", "input")
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    try:  # the body's own bounds are the chat request's: this only guards against their drifting apart
        chat = ChatCompletionRequest(
            model=body.model, messages=system + conversation, max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, user=body.user,
            stream=body.stream, stream_options=StreamOptions(include_usage=True) if body.stream else None,
            response_format=_response_format(body),
            tools=[Tool(type="function", function=_function(t)) for t in body.tools] if body.tools else None,
            tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls)
    except ValidationError as e:
        raise invalid_chat_request(e) from None
    return chat, conversation


def item_messages(items: Sequence[Message | FunctionCall | FunctionCallOutput]) -> list[ChatMessage]:
    """Input (or output) items as chat messages, in order: a run of function calls is the
    `tool_calls` of the assistant message just before it (a message of its own if none is)."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutput):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        else:
            out.append(ChatMessage(role=item.role, content=item.text()))
    return out


def responses_name(chat_name: str) -> str:
    """A chat request's parameter (dotted, as an error names it) as the Responses API names
    it: `max_tokens` max_output_tokens, `response_format.json_schema.name` text.format.name
    and `tools.0.function.name` tools.0.name (flat, as the Responses API's are), and any of
    `messages` input (a message's index counts the instructions and the stored history, and
    function calls join the message before them: it is no index into `input`)."""
    head, *rest = chat_name.split(".")
    if head == "messages":
        return "input"
    if head == "tools" and rest[1:2] == ["function"]:
        del rest[1]
    if head == "response_format" and rest[:1] == ["json_schema"]:
        del rest[0]
    return ".".join([_PARAMS.get(head, head), *rest])


def invalid_chat_request(e: ValidationError) -> APIError:
    """A 400 for the chat request a Responses request made, naming the Responses field."""
    error = e.errors()[0]
    param = responses_name(".".join(map(str, error["loc"])))
    return APIError(400, f"{param}: {error['msg']}", param)


def responses_error(e: APIError) -> APIError:
    """An APIError of the chat path's, naming the Responses API's parameter where it has
    its own name for it, in its `param` and its message (max_output_tokens for max_tokens,
    input for messages, ...)."""
    if e.param is None or (param := responses_name(e.param)) == e.param:
        return e
    message = e.message
    leading = _LEADING_NAME.match(message)
    if leading and leading.group().partition(".")[0] == e.param.partition(".")[0]:  # "messages.3.content: ..."
        message = responses_name(leading.group()) + message[leading.end():]
    for chat, ours in _PARAMS.items():  # elsewhere only the names no other word is: max_tokens, response_format
        if chat != "messages":
            message = re.sub(rf"\b{chat}\b", ours, message)
    return APIError(e.status, message, param, e.code, e.headers, e.reason)


def _refuse_unserved(body: ResponsesRequest) -> None:
    """A 400 naming the first field set that this server does not serve."""
    if body.reasoning and any(v is not None for v in body.reasoning.values()):  # {} or {"effort": null}: none asked
        raise APIError(400, "reasoning: this model does not reason (no reasoning effort or summary to set)",
                       "reasoning")
    if body.background:
        raise APIError(400, "background: background responses are not served; stream the answer instead",
                       "background")
    if body.include:
        raise APIError(400, f"include: {body.include[0]!r} is not served (nothing can be included)", "include")
    if body.conversation is not None:
        raise APIError(400, "conversation: conversations are not served; chain responses with "
                            "previous_response_id", "conversation")
    for i, tool in enumerate(body.tools or ()):
        if isinstance(tool, BuiltInTool):
            raise APIError(400, f"tools.{i}: built-in tool {tool.type!r} is not served; only type \"function\"",
                           f"tools.{i}.type")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text" and body.tools and (
            body.tool_choice == "required" or isinstance(body.tool_choice, NamedFunction)):
        raise APIError(400, 'text.format cannot be combined with tool_choice "required" or a named function: '
                            "the output is the call", "text.format")


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))


def _function(tool: FunctionTool) -> FunctionSpec:
    spec = FunctionSpec(name=tool.name, description=tool.description, strict=tool.strict)
    if tool.parameters is not None:
        spec.parameters = tool.parameters
    return spec


def _tool_choice(choice: str | NamedFunction | None):
    if isinstance(choice, NamedFunction):
        return NamedToolChoice(type="function", function=ChatNamedFunction(name=choice.name))
    return choice
