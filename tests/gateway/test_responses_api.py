"""OpenAI's Responses API (`POST /v1/responses`) on the 1P+1D deployment, with the official
`openai` client as the reference: created and streamed answers agree, greedy text equals
the chat API's for the same conversation, the typed event sequence numbered from 0,
structured output parsed into a pydantic model, a function tool round trip (through
`previous_response_id` and with the items sent back, alike), `max_output_tokens` making an
answer incomplete, refusals naming their field, stored responses kept apart per tenant and
found by every process of a gateway that runs two, and a client leaving mid-stream giving
its slot and KV back as on the chat path. The translation, the events and the store
without a gateway: test_openai_responses_{request,answer,store}.py."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
from typing import NamedTuple

import httpx
import jsonschema
import openai
import psutil
import pytest
from pydantic import BaseModel, Field

from bench.harness.gateway_procs import data_lines, gateway, serving_process
from bench.harness.worker_procs import wait_idle, wait_until

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SYSTEM = "You are a terse assistant."
CONVERSATION = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Name another one, and say why you like it."}]
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_create_and_stream_agree(client):
    kwargs = {"model": "smollm2", "max_output_tokens": 24, "instructions": SYSTEM, "input": CONVERSATION,
              "temperature": 0}
    reply = client.responses.create(**kwargs)
    assert reply.object == "response" and reply.model == "smollm2" and reply.instructions == SYSTEM
    assert reply.status in ("completed", "incomplete") and reply.output_text
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.usage.input_tokens > 20 and 0 < reply.usage.output_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    raw = client.responses.with_raw_response.create(**kwargs)  # how it was served, as the chat API's says it
    assert raw.headers["x-pdserve-prefill"] in ("remote", "local") and raw.headers["x-pdserve-decode-worker"], \
        raw.headers
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    final = events[-1].response
    assert final.output_text == reply.output_text and final.status == reply.status
    assert final.usage.output_tokens == reply.usage.output_tokens
    assert reply.status == "completed"  # this greedy answer ends before its limit: the stream below completes
    with client.responses.stream(**kwargs) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == reply.output_text
    assert text == reply.output_text


def test_greedy_text_equals_the_chat_apis(client):
    """One conversation, one path: /v1/responses and /v1/chat/completions answer alike."""
    reply = client.responses.create(model="smollm2", max_output_tokens=32, instructions=SYSTEM,
                                    input=CONVERSATION, temperature=0)
    chat = client.chat.completions.create(model="smollm2", max_tokens=32, temperature=0,
                                          messages=[{"role": "system", "content": SYSTEM}, *CONVERSATION])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]


def test_the_stream_is_openais_event_sequence(system):
    """Cut by max_output_tokens: each event named and numbered, ending in response.incomplete."""
    body = {"model": "smollm2", "max_output_tokens": 6, "input": ASK, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{system[0]}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-pdserve-decode-worker"] == system[2].name, r.headers
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(d.removeprefix("data: ")) for d in data_lines(lines)]
    assert [e["type"] for e in events] == names
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress", *TEXT_EVENTS]
    assert names[4:-4] == ["response.output_text.delta"] * (len(names) - 8) and len(names) > 8
    assert names[-4:] == [*TEXT_DONE, "response.incomplete"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 6 and final["output"][0]["status"] == "incomplete"
    assert events[0]["response"]["id"] == final["id"] and events[0]["response"]["status"] == "in_progress"
    assert final["output"][0]["content"][0]["text"] == "".join(e["delta"] for e in events[4:-4])


def test_max_output_tokens_makes_it_incomplete(client):
    reply = client.responses.create(model="smollm2", max_output_tokens=5, input=ASK, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens", reply
    assert reply.usage.output_tokens == 5 and reply.output[0].status == "incomplete"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_parse_fills_a_pydantic_model(client):
    """text.format json_schema (strict, as `responses.parse` sends it) through the grammar path."""
    reply = client.responses.parse(model="smollm2", max_output_tokens=80, text_format=City, temperature=0,
                                   input=[{"role": "user", "content": "Name a big city and its country, as JSON."}])
    assert reply.status == "completed", reply
    assert isinstance(reply.output_parsed, City) and reply.output_parsed.name, reply
    assert reply.text.format.type == "json_schema" and reply.text.format.strict is True
    loose = client.responses.create(model="smollm2", max_output_tokens=60, temperature=0, input=ASK,
                                    text={"format": {"type": "json_object"}})
    assert loose.status == "completed" and isinstance(json.loads(loose.output_text), dict), loose


def test_a_function_tool_round_trip(client):
    """A named function is called with arguments valid under its schema; its output goes back
    either after previous_response_id or with the items sent back by the client: the same
    conversation, so the same greedy answer."""
    first = client.responses.create(model="smollm2", max_output_tokens=60, input=ASK, tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    kwargs = {"model": "smollm2", "max_output_tokens": 24, "tools": TOOLS, "tool_choice": "none",
              "temperature": 0}
    chained = client.responses.create(**kwargs, previous_response_id=first.id, input=[result])
    assert chained.previous_response_id == first.id and [o.type for o in chained.output] == ["message"]
    resent = client.responses.create(**kwargs, input=[*ASK, *first.output, result], store=False)
    assert resent.output_text == chained.output_text and resent.usage.input_tokens == chained.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store false: nothing to chain to
        client.responses.create(**kwargs, previous_response_id=resent.id, input="And tomorrow?")
    assert client.responses.retrieve(chained.id).output_text == chained.output_text


def test_a_required_call_streams_its_arguments(client):
    events = list(client.responses.create(model="smollm2", max_output_tokens=80, input=ASK, tools=TOOLS,
                                          temperature=0, tool_choice="required", parallel_tool_calls=False,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"], events
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather" and events[2].item.call_id == call.call_id
    assert events[3].delta == events[4].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def _refusal(client, error: type, **kwargs):
    with pytest.raises(error) as e:
        client.responses.create(**{"model": "smollm2", "max_output_tokens": 4, "input": ASK, **kwargs})
    return e.value


def test_what_cannot_be_served_is_refused_naming_the_field(client, system):
    """Each refusal names what is wrong, in OpenAI's error shape, with the right status."""
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # auto: SmolLM2's chat template shows the model no tools
        ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ]
    for kwargs, param in cases:
        e = _refusal(client, openai.BadRequestError, **kwargs)
        assert e.body["type"] == "invalid_request_error" and (e.param or "").startswith(param), (kwargs, e.body)
        assert param.split(".")[0] in e.body["message"], (kwargs, e.body)
    assert _refusal(client, openai.NotFoundError, model="nope").param == "model"
    e = _refusal(client, openai.NotFoundError, previous_response_id="resp_unknown")
    assert e.param == "previous_response_id" and "not found" in e.body["message"]
    r = httpx.post(f"{system[0]}/v1/responses", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{system[0]}/v1/responses", json={"model": "smollm2"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


class Keyed(NamedTuple):
    url: str
    front: subprocess.Popen  # the front process of its two gateway processes


@pytest.fixture(scope="module")
def keyed(system, smollm2_dir, tmp_path_factory):
    """A second gateway over the same workers, as two gateway processes, with API keys:
    tenant a runs 1 request at a time (across both); tenant b is another."""
    folder = tmp_path_factory.mktemp("responses-tenants")
    (folder / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "a", "api_keys": ["key-a"], "max_concurrent": 1}, {"name": "b", "api_keys": ["key-b"]}]}))
    started: list[subprocess.Popen] = []
    with gateway(smollm2_dir, [system[2].address], [system[1].address], folder / "gateway.log",
                 "--tenants", str(folder / "tenants.json"), processes=2, started=started) as url:
        keyed = Keyed(url, started[0])
        wait_until(lambda: len(_processes(keyed)) == 2, 30, "two gateway processes")
        yield keyed


def _processes(keyed: Keyed) -> set[int]:
    return {p.pid for p in psutil.Process(keyed.front.pid).children()}


def test_a_stored_response_is_its_tenants_alone(keyed):
    """Another tenant's previous_response_id, or GET of its response, is not found, as an
    unknown id is; its own tenant chains to it and reads it back."""
    a = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="key-b", max_retries=0)
    first = a.responses.create(model="smollm2", max_output_tokens=4, input=ASK, temperature=0)
    assert a.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    e = _refusal(b, openai.NotFoundError, previous_response_id=first.id)
    assert "not found" in e.body["message"] and e.param == "previous_response_id"
    assert a.responses.create(model="smollm2", max_output_tokens=4, input="And tomorrow?",
                              previous_response_id=first.id).output


def test_every_gateway_process_finds_what_another_stored(keyed):
    """Each request on a connection of its own, mapped to the gateway process that took it,
    until each process has continued (previous_response_id) and read back (GET) a response
    the other stored, and refused tenant b both, 404 as an unknown id. Each continuation
    carries the whole conversation: its prompt grows turn by turn."""
    stored_by: dict[str, int] = {}  # response id -> the process that stored it
    continued, read, refused = set(), set(), set()
    pid, first = _created(keyed, {"input": ASK})
    stored_by[first["id"]] = pid
    last = first
    deadline = time.monotonic() + 120
    while not continued == read == refused == _processes(keyed):
        assert time.monotonic() < deadline, (continued, read, refused, _processes(keyed))
        pid, reply = _created(keyed, {"input": "And then?", "previous_response_id": last["id"]})
        assert reply["previous_response_id"] == last["id"]
        assert reply["usage"]["input_tokens"] > last["usage"]["input_tokens"], (reply["usage"], last["usage"])
        if stored_by[last["id"]] != pid:
            continued.add(pid)
        stored_by[reply["id"]] = pid
        last = reply
        for rid in (first["id"], last["id"]):
            pid, status, got = _request(keyed, "GET", f"/v1/responses/{rid}", "key-a")
            assert status == 200 and got == (first if rid == first["id"] else last), got
            if stored_by[rid] != pid:
                read.add(pid)
        for method, path, body in (("GET", f"/v1/responses/{last['id']}", None),
                                   ("POST", "/v1/responses", {"model": "smollm2", "input": "Hi",
                                                              "previous_response_id": last["id"]})):
            pid, status, got = _request(keyed, method, path, "key-b", body)
            assert status == 404 and "not found" in got["error"]["message"], got
            if stored_by[last["id"]] != pid:
                refused.add(pid)


def _created(keyed: Keyed, body: dict) -> tuple[int, dict]:
    """Tenant a's response to `body` (two greedy tokens at most): (the process that took it, it)."""
    pid, status, reply = _request(keyed, "POST", "/v1/responses", "key-a",
                                  {"model": "smollm2", "max_output_tokens": 2, "temperature": 0, **body})
    assert status == 200 and reply["status"] in ("completed", "incomplete"), reply
    return pid, reply


def _request(keyed: Keyed, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, int, dict]:
    """One request on a connection of its own: (the process that took it, the status, the
    JSON answer)."""
    host, port = keyed.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode() if body is not None else b""
    with contextlib.closing(socket.create_connection((host, int(port)), timeout=60)) as conn:
        conn.sendall(f"{method} {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = conn.recv(65536)
            assert chunk, f"connection closed mid-answer: {answer!r}"
            answer += chunk
        head, _, content = answer.partition(b"\r\n\r\n")
        return serving_process(keyed.front, conn), int(head.split()[1]), json.loads(content)


def _length(answer: bytes) -> int:
    """The Content-Length of an answer whose head has come (0 until then)."""
    m = re.search(rb"(?im)^content-length: *(\d+)", answer.partition(b"\r\n\r\n")[0])
    return int(m.group(1)) if m else 0


def test_a_client_leaving_mid_stream_gives_its_slot_and_kv_back(keyed, system):
    a = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="key-a", max_retries=0)
    with a.responses.create(model="smollm2", max_output_tokens=400, input=ASK, temperature=0.8,
                            stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break  # tenant a's one slot is taken
        assert _refusal(a, openai.RateLimitError).body["type"] == "rate_limit_error"
    # the client left mid-stream: its slot and its KV come back
    wait_until(lambda: _served(a), 20, "tenant a's slot back")
    s = wait_idle(system[2])
    assert s.running_requests == 0 and s.free_blocks == s.total_blocks, s


def _served(client) -> bool:
    try:
        client.responses.create(model="smollm2", max_output_tokens=1, input=ASK, store=False)
    except openai.RateLimitError:
        return False
    return True


def test_an_aggregated_system_answers_as_its_chat_api_does(aggregated):
    """With no prefill worker (the decode worker prefills locally) the Responses API is the
    same path: greedy text equal to the chat API's on that gateway, streamed or not."""
    kwargs = {"model": "smollm2", "max_output_tokens": 24, "instructions": SYSTEM, "input": CONVERSATION,
              "temperature": 0}
    reply = aggregated.responses.create(**kwargs)
    chat = aggregated.chat.completions.create(model="smollm2", max_tokens=24, temperature=0,
                                              messages=[{"role": "system", "content": SYSTEM}, *CONVERSATION])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    events = list(aggregated.responses.create(**kwargs, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
