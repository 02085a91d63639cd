"""Anthropic's Messages API (`POST /v1/messages`) on the 1P+1D deployment, with the official
`anthropic` client as the reference: created and streamed answers agree, greedy text equals
the chat API's for the same conversation, a tool round trip (tool_use, then tool_result),
Anthropic's event sequence and error shape, and a tenant's key taken from `x-api-key`, its
limits and a client leaving mid-stream the same as on the chat path."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from bench.harness.gateway_procs import data_lines, gateway
from bench.harness.worker_procs import wait_idle, wait_until
from gateway.messages.protocol import MessagesRequest
from gateway.messages.request import chat_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SYSTEM = "You are a terse assistant."
GREEDY = {"temperature": 0}  # the anthropic client takes sampling parameters as extra body fields
CONVERSATION = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Name another one, and say why you like it."}]


def test_a_conversations_blocks_become_chat_messages_in_order():
    body = MessagesRequest.model_validate({
        "model": "smollm2", "max_tokens": 8,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "21C"}]},
                                         {"type": "tool_result", "tool_use_id": "t2", "content": "down",
                                          "is_error": True},
                                         {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]}],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"], "stream": True, "metadata": {"user_id": "u1"}})
    chat = chat_request(body, template_renders_tools=False)
    assert [(m.role, m.text(), m.tool_call_id) for m in chat.messages] == [
        ("system", "Be brief.", None), ("user", "Weather?", None), ("assistant", "Checking.", None),
        ("tool", "21C", "t1"), ("tool", "Error: down", "t2"), ("user", "Thanks", None)]
    assert chat.messages[2].tool_calls == [{"id": "t1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.stop == ["\n\n"]
    assert chat.stream and chat.stream_options.include_usage and chat.user == "u1" and chat.max_tokens == 8
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER


@pytest.fixture(scope="module")
def claude(system):
    """The official `anthropic` client on the shared deployment's gateway."""
    return anthropic.Anthropic(base_url=system[0], api_key="unused", max_retries=0)


def test_create_and_stream_agree(claude):
    kwargs = {"model": "smollm2", "max_tokens": 24, "system": SYSTEM, "messages": CONVERSATION,
              "extra_body": GREEDY}
    reply = claude.messages.create(**kwargs)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "smollm2"
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    (block,) = reply.content
    assert block.type == "text" and block.text
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 20
    assert 0 < reply.usage.output_tokens <= 24
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == block.text
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == reply.usage.output_tokens


def test_greedy_text_equals_the_chat_apis(claude, client):
    """One conversation, one path: /v1/messages and /v1/chat/completions answer alike."""
    reply = claude.messages.create(model="smollm2", max_tokens=32, system=SYSTEM, messages=CONVERSATION,
                                   extra_body=GREEDY)
    chat = client.chat.completions.create(model="smollm2", max_tokens=32, temperature=0,
                                          messages=[{"role": "system", "content": SYSTEM}, *CONVERSATION])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]


def test_the_stream_is_anthropics_event_sequence(system):
    body = {"model": "smollm2", "max_tokens": 6, "messages": ASK, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{system[0]}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(d.removeprefix("data: ")) for d in data_lines(lines)]
    assert [e["type"] for e in events] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6) and len(names) > 6
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6
    assert all(e["delta"]["type"] == "text_delta" for e in events[3:-3])


def test_max_tokens_and_stop_sequences_end_the_text(claude):
    base = claude.messages.create(model="smollm2", max_tokens=20, messages=ASK, extra_body=GREEDY)
    text = base.content[0].text
    assert base.stop_reason == "max_tokens" and base.usage.output_tokens == 20, base
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = claude.messages.create(model="smollm2", max_tokens=20, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=[stop])
    # the text ends where the chat API's stop string would end it, and says which one did
    assert cut.content[0].text == text[:text.index(stop)], cut
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
    with claude.messages.stream(model="smollm2", max_tokens=20, messages=ASK, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop, streamed


def test_a_tool_round_trip(claude):
    """A named tool is called with input valid under its schema (stop_reason tool_use), then
    its result goes back as a tool_result and the model answers in text."""
    first = claude.messages.create(model="smollm2", max_tokens=60, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"temperature": 21, "sky": "clear"}'}]}]
    reply = claude.messages.create(model="smollm2", max_tokens=24, messages=history, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "none"})
    assert reply.stop_reason in ("end_turn", "max_tokens") and [b.type for b in reply.content] == ["text"], reply


def test_any_tool_streams_its_input_as_json_deltas(claude):
    with claude.messages.stream(model="smollm2", max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(deltas)) == call.input


def _refusal(claude, error: type, **kwargs) -> dict:
    body = {"model": "smollm2", "max_tokens": 4, "messages": ASK, **kwargs}
    with pytest.raises(error) as e:
        claude.messages.create(**body)
    assert e.value.body["type"] == "error", e.value.body
    return e.value.body["error"]


def test_what_cannot_be_served_is_refused_in_anthropics_shape(claude, system):
    """Each refusal names what is wrong, in Anthropic's error shape, with the right status."""
    cases = [
        ({"extra_body": {"thinking": {"type": "enabled", "budget_tokens": 1024}}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "last message"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tools": TOOLS}, '"any"'),  # SmolLM2's chat template shows the model no tools
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}, *ASK]},
         "tool_result"),
    ]
    for kwargs, why in cases:
        error = _refusal(claude, anthropic.BadRequestError, **kwargs)
        assert error["type"] == "invalid_request_error" and why in error["message"], (kwargs, error)
    assert _refusal(claude, anthropic.NotFoundError, model="nope")["type"] == "not_found_error"
    r = httpx.post(f"{system[0]}/v1/messages", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    r = httpx.post(f"{system[0]}/v1/messages", json={"model": "smollm2", "messages": ASK}, timeout=10)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def keyed(system, smollm2_dir, tmp_path_factory):
    """A second gateway over the same workers with API keys: tenant m runs 1 request at a time."""
    folder = tmp_path_factory.mktemp("messages-tenants")
    (folder / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "m", "api_keys": ["key-m"], "max_concurrent": 1}]}))
    with gateway(smollm2_dir, [system[2].address], [system[1].address], folder / "gateway.log",
                 "--tenants", str(folder / "tenants.json")) as url:
        yield url


def test_a_tenants_key_is_taken_from_x_api_key(keyed, system):
    """The key as Anthropic's clients send it (x-api-key) or as a bearer token; a tenant at
    its limit gets Anthropic's 429; a stream its client leaves gives its slot and KV back."""
    ok = anthropic.Anthropic(base_url=keyed, api_key="key-m", max_retries=0)
    assert ok.messages.create(model="smollm2", max_tokens=2, messages=ASK).content
    bearer = anthropic.Anthropic(base_url=keyed, auth_token="key-m", api_key=None, max_retries=0)
    assert bearer.messages.create(model="smollm2", max_tokens=2, messages=ASK).content
    for key in ("nope", "key-"):
        error = _refusal(anthropic.Anthropic(base_url=keyed, api_key=key, max_retries=0),
                         anthropic.AuthenticationError)
        assert error["type"] == "authentication_error", error
    chat = httpx.post(f"{keyed}/v1/chat/completions", headers={"x-api-key": "key-m"}, timeout=60,
                      json={"model": "smollm2", "max_tokens": 2, "messages": ASK})
    assert chat.status_code == 200, chat.text
    with ok.messages.stream(model="smollm2", max_tokens=400, messages=ASK,
                            extra_body={"temperature": 0.8}) as stream:
        next(iter(stream.text_stream))  # tenant m's one slot is taken
        assert _refusal(ok, anthropic.RateLimitError)["type"] == "rate_limit_error"
    # the client left mid-stream: its slot and its KV come back
    wait_until(lambda: _served(ok), 20, "tenant m's slot back")
    s = wait_idle(system[2])
    assert s.running_requests == 0 and s.free_blocks == s.total_blocks, s


def _served(claude) -> bool:
    try:
        claude.messages.create(model="smollm2", max_tokens=1, messages=ASK)
    except anthropic.RateLimitError:
        return False
    return True


def test_an_aggregated_system_answers_as_its_chat_api_does(aggregated):
    """With no prefill worker (the decode worker prefills locally) the Messages API is the
    same path: greedy text equal to the chat API's on that gateway, streamed or not."""
    local = anthropic.Anthropic(base_url=str(aggregated.base_url).rstrip("/").removesuffix("/v1"),
                                api_key="unused", max_retries=0)
    kwargs = {"model": "smollm2", "max_tokens": 24, "system": SYSTEM, "messages": CONVERSATION,
              "extra_body": GREEDY}
    reply = local.messages.create(**kwargs)
    chat = aggregated.chat.completions.create(model="smollm2", max_tokens=24, temperature=0,
                                              messages=[{"role": "system", "content": SYSTEM}, *CONVERSATION])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    with local.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == reply.content[0].text
