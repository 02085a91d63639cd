"""A Responses request as the chat request it means (gateway/responses/request.py),
without a gateway: input items in order, what is refused and what is not, and errors
naming the Responses API's field in their `param` and their message alike."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import APIError
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.request import chat_request, invalid_chat_request, responses_error
from gateway.completions.protocol import ChatCompletionRequest, ChatMessage

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]


def test_input_items_become_chat_messages_in_order():
    body = ResponsesRequest.model_validate({
        "model": "smollm2", "instructions": "Be brief.", "max_output_tokens": 8, "stream": True, "seed": 7,
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Use "},
                                              {"type": "input_text", "text": "tools."}]},
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25C"}]},
            {"role": "user", "content": "Thanks"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
    earlier = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello.")]
    chat, conversation = chat_request(body, earlier)
    assert [(m.role, m.text(), m.tool_call_id) for m in chat.messages] == [
        ("system", "Be brief.", None), ("user", "Hi", None), ("assistant", "Hello.", None),
        ("developer", "Use tools.", None), ("user", "Weather?", None), ("assistant", "Checking.", None),
        ("tool", "21C", "c1"), ("tool", "25C", "c2"), ("user", "Thanks", None)]
    assert [c["id"] for c in chat.messages[5].tool_calls] == ["c1", "c2"]
    assert chat.messages[5].tool_calls[1]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert conversation == chat.messages[1:]  # what a stored answer keeps: all but the instructions
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER and chat.tools[0].function.strict is True
    assert chat.max_tokens == 8 and chat.seed == 7 and chat.stream and chat.stream_options.include_usage
    schema = {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}
    chat, _ = chat_request(ResponsesRequest.model_validate({"model": "smollm2", "input": "Paris?",
                                                            "text": {"format": schema}}), ())
    assert [(m.role, m.text()) for m in chat.messages] == [("user", "Paris?")]
    assert chat.response_format.json_schema.schema_ == WEATHER and chat.response_format.json_schema.strict


@pytest.mark.parametrize("reasoning", [{}, {"effort": None}, {"effort": None, "summary": None}])
def test_reasoning_that_asks_for_nothing_is_served(reasoning):
    body = ResponsesRequest.model_validate({"model": "smollm2", "input": "Hi", "reasoning": reasoning})
    chat, _ = chat_request(body, ())
    assert [m.text() for m in chat.messages] == ["Hi"]


@pytest.mark.parametrize("reasoning", [{"effort": "low"}, {"summary": "auto"}, {"effort": None, "summary": "auto"}])
def test_reasoning_that_asks_for_effort_or_a_summary_is_refused(reasoning):
    body = ResponsesRequest.model_validate({"model": "smollm2", "input": "Hi", "reasoning": reasoning})
    with pytest.raises(APIError) as e:
        chat_request(body, ())
    assert e.value.status == 400 and e.value.param == "reasoning"


@pytest.mark.parametrize("chat, param", [
    ({"messages": [{"role": "nobody"}]}, "input"),  # no index: a message's is not the input's
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": ""}}}, "text.format.name"),
])
def test_a_chat_request_that_does_not_validate_names_the_responses_field(chat, param):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                              **chat})
    error = invalid_chat_request(e.value)
    assert error.status == 400 and error.param == param and error.message.startswith(f"{param}: "), error.message


@pytest.mark.parametrize("chat, ours", [
    (APIError(400, "messages.3.content: only text content parts are supported", "messages"),
     ("input", "input: only text content parts are supported")),
    (APIError(400, "messages: text is not valid Unicode (unpaired surrogate?)", "messages"),
     ("input", "input: text is not valid Unicode (unpaired surrogate?)")),
    (APIError(413, "6 messages cannot fit in this model's limit of 2048 tokens", "messages"),
     ("input", "6 messages cannot fit in this model's limit of 2048 tokens")),
    (APIError(400, "max_tokens (9) is over this server's limit of 8", "max_tokens"),
     ("max_output_tokens", "max_output_tokens (9) is over this server's limit of 8")),
    (APIError(400, "prompt (3 tokens) + max_tokens (9) exceeds the context", "max_tokens"),
     ("max_output_tokens", "prompt (3 tokens) + max_output_tokens (9) exceeds the context")),
    (APIError(400, "response_format: not a schema", "response_format"), ("text.format", "text.format: not a schema")),
    (APIError(400, "temperature: too hot", "temperature"), ("temperature", "temperature: too hot")),
])
def test_a_chat_path_error_is_said_in_the_responses_apis_words(chat, ours):
    e = responses_error(chat)
    assert (e.param, e.message) == ours and e.status == chat.status
