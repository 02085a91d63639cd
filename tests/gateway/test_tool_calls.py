"""Tool calls with the official `openai` client: a named function and tool_choice "required"
generate calls under grammars built from the functions' parameter schemas (validated by
`jsonschema`), returned as `tool_calls` and streamed as `delta.tool_calls`, on the 1P+1D
deployment and an aggregated one; tool results go back through the chat template; "auto"
is served where the template shows the model its tools (Hermes-format calls parsed) and
refused clearly where it does not (SmolLM2's)."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from common.tokenizer import Tokenizer
from gateway.completions.tools import FunctionSpec, ToolPlan

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(params=["1P+1D", "aggregated"])
def api(request, client):
    return request.getfixturevalue("aggregated") if request.param == "aggregated" else client


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(api):
    reply = api.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _valid(call)


def test_required_streams_its_calls_as_delta_tool_calls(api):
    stream = api.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0.7, seed=3, max_tokens=80,
                                         stream=True)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(deltas) == 1, chunks
    (call,) = deltas
    assert call.index == 0 and call.function.name in SCHEMAS
    _valid(call)


def test_required_without_a_limit_returns_every_call_valid(client):
    reply = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls, reply
    for call in calls:
        _valid(call)


def test_tool_results_go_back_through_the_chat_template(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    reply = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls


def test_what_cannot_be_served_is_a_400_naming_it(system):
    url = system[0]
    base = {"model": "smollm2", "messages": ASK, "max_tokens": 4}
    cases = [({"tools": TOOLS}, "auto"), ({"tools": TOOLS, "tool_choice": "auto"}, "chat template"),
             ({"tool_choice": "required"}, "needs tools"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
             ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "unique"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
               "tool_choice": "required"}, "Unsupported type"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format")]
    for extra, why in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (extra, r.text)
        assert r.json()["error"]["param"] in ("tools", "tool_choice", "response_format"), r.text


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions: {{ tools | tojson }}. Answer with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_auto_shows_a_tools_template_the_tools_and_parses_hermes_calls(smollm2_dir, tmp_path):
    folder = tmp_path / "with-tools"
    shutil.copytree(smollm2_dir, folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.renders_tools and not Tokenizer.from_pretrained(smollm2_dir).renders_tools
    from gateway.completions.tools import Tool

    plan = ToolPlan.of([Tool.model_validate(t) for t in TOOLS], None, None, tok.renders_tools)
    assert plan.mode == "auto" and plan.grammar is None
    assert "get_weather" in tok.apply_chat_template(ASK, tools=plan.render)
    calls, content = plan.calls('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                                '"unit": "celsius"}}</tool_call>')
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert plan.calls("Just text.") == (None, "Just text.")
    assert plan.calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[0] is None
    assert isinstance(plan.functions["get_time"], FunctionSpec)
