"""Structured output (`response_format`): every output parses and validates against its
schema (checked by `jsonschema`, a validator nobody here wrote), greedy and sampled, in the
engine and through the gateway with the official `openai` client, on the 1P+1D deployment
(the first token sampled under the grammar on the prefill worker, the rest on the decode
worker) and on an aggregated one; rows without a schema sample exactly as before; bad
schemas are 400s that say what is wrong."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from common.grammar_spec import MAX_SCHEMA_CHARS, Grammar
from common.sampling_params import SamplingParams, SamplingParamsError
from engine.grammar import Grammars, allowed_next

NESTED = {"type": "object", "properties": {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "active": {"type": "boolean"}}, "required": ["person", "active"]}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 4}
ENUMS = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "string", "enum": ["S", "M", "L"]}},
         "required": ["color", "size"], "additionalProperties": False}
BOUNDS = {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -5.5, "maximum": 40},
                                           "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
          "required": ["celsius", "count"]}
SCHEMAS = {"nested": NESTED, "array": ARRAY, "enums": ENUMS, "bounds": BOUNDS}
ASK = "Reply with JSON only. Describe Ann, 31, in a red medium shirt, on a 21.5 degree day."


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from engine.llm import LLM

    return LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256)


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_and_sampled_outputs_follow_their_schema(llm, name):
    schema = SCHEMAS[name]
    grammar = Grammar(json.dumps(schema))
    greedy = SamplingParams(temperature=0, max_tokens=160, grammar=grammar)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, grammar=grammar) for s in range(3)]
    outs = llm.chat([[{"role": "user", "content": ASK}]] * 4, [greedy, *sampled])
    for out in outs:
        assert out.finish_reason.value == "stop", out.text
        _check(out.text, schema)


def test_rows_without_a_schema_sample_as_before_beside_rows_with_one(llm):
    ask = [{"role": "user", "content": ASK}]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.chat([ask], plain)[0].token_ids
    beside = llm.chat([ask, ask], [plain, SamplingParams(temperature=0, max_tokens=24, grammar=Grammar(
        json.dumps(ENUMS)))])
    assert beside[0].token_ids == alone
    assert beside[1].token_ids != alone  # the schema's row did change


def test_a_matcher_catches_up_from_the_output_however_it_arrives(smollm2_dir, llm):
    """The decode worker's matcher starts after the prefill worker's first token; after a
    recompute it meets the same output again: the masks are the same either way."""
    cfg = llm.engine.model.cfg
    grammars = Grammars.from_folder(smollm2_dir, cfg.vocab_size, cfg.eos_token_ids)
    grammar = Grammar(json.dumps(NESTED))
    out = llm.chat([{"role": "user", "content": ASK}], SamplingParams(temperature=0, max_tokens=12,
                                                                      grammar=grammar))[0].token_ids
    step_by_step, at_once = grammars.matcher(grammar), grammars.matcher(grammar)
    for n in range(1, len(out)):
        allowed_next([step_by_step], [out[:n]], cfg.vocab_size)
    (_, a), (_, b) = allowed_next([step_by_step], [out], cfg.vocab_size), allowed_next([at_once], [out], cfg.vocab_size)
    assert a.equal(b) and 0 < int(a.sum()) < cfg.vocab_size
    (_, back), (_, fresh) = (allowed_next([step_by_step], [out[:3]], cfg.vocab_size),  # tokens taken back
                             allowed_next([grammars.matcher(grammar)], [out[:3]], cfg.vocab_size))
    assert back.equal(fresh)
    assert allowed_next([grammars.matcher(grammar)], [[cfg.eos_token_ids[0]]], cfg.vocab_size) is None  # refused


def test_outputs_still_follow_their_schema_through_preemption_and_recompute(smollm2_dir):
    """A KV pool too small for the batch: requests are preempted, their KV dropped and
    recomputed from prompt + output; their matchers meet the same output again."""
    from engine.llm import LLM

    small = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=24, max_num_seqs=8)
    grammar = Grammar(json.dumps(NESTED))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, grammar=grammar) for s in range(6)]
    outs = small.chat([[{"role": "user", "content": f"{ASK} ({i})"}] for i in range(6)], params)
    assert small.engine.stats().num_preemptions > 0  # the case under test happened
    for out in outs:
        assert out.finish_reason.value == "stop", out.text
        _check(out.text, NESTED)


def test_a_compile_past_its_bound_is_refused_not_waited_for(smollm2_dir, llm):
    cfg = llm.engine.model.cfg
    grammars = Grammars.from_folder(smollm2_dir, cfg.vocab_size, cfg.eos_token_ids)
    wide = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}@[a-z]+\\.(com|org)"}
                                             for i in range(40)}}
    tight = Grammars.from_folder(smollm2_dir, cfg.vocab_size, cfg.eos_token_ids, budget_s=grammars.reference_s / 100)
    for _ in range(2):  # the second from the cache: refused alike, not compiled again
        with pytest.raises(ValueError, match="did not compile within"):
            tight.compile(Grammar(json.dumps(wide)))
    assert tight.num_compiles == 1


def test_bad_schemas_and_combinations_are_refused_in_the_engine(smollm2_dir, llm):
    cfg = llm.engine.model.cfg
    grammars = Grammars.from_folder(smollm2_dir, cfg.vocab_size, cfg.eos_token_ids)
    for schema, why in (('{"type": "foo"}', "Unsupported type"), ("not json", "not valid JSON"),
                        ('{"type": "integer", "minimum": 5, "maximum": 1}', "minimum greater than maximum"),
                        ('{"type": "string", "pattern": "[a-z"}', "Unclosed")):
        with pytest.raises(ValueError, match=why):
            grammars.compile(Grammar(schema))
    with pytest.raises(ValueError, match="at most"):
        Grammar(" " * (MAX_SCHEMA_CHARS + 1))
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=Grammar("{}"))


# -- through the gateway, with the official client ------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    colors: list[Literal["red", "green", "blue"]] = Field(max_length=3)


@pytest.fixture(params=["1P+1D", "aggregated"])
def api(request, system, client):
    if request.param == "aggregated":
        return request.getfixturevalue("aggregated"), None
    return client, system[2]


def _parse(client: OpenAI, content: str):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return parse(model="smollm2", messages=[{"role": "user", "content": content}], response_format=Person,
                 temperature=0, max_tokens=120)


def test_parse_with_a_pydantic_model(api):
    client, decode = api
    moved = decode.stats().kv_blocks_transferred if decode else 0
    reply = _parse(client, f"{ASK} Which colors does Ann like? (parse {decode is None})")
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person), choice.message.content
    if decode is not None:  # the prompt's KV came from the prefill worker: its first token too
        assert decode.stats().kv_blocks_transferred > moved


def test_json_object_and_a_streamed_schema(api):
    client, _ = api
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give Ann's name and age (31) as a JSON object."}],
        temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": f"{ASK} (stream)"}], temperature=0.8, seed=7,
        max_tokens=160, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": NESTED, "strict": True}})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    _check("".join(c.choices[0].delta.content or "" for c in chunks), NESTED)


def test_an_unfinished_output_ends_at_max_tokens_with_length(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": NESTED}})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_bad_response_formats_are_400s_naming_the_problem(system):
    url = system[0]
    base = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "foo"}}}, "Unsupported type"),
             ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "integer", "minimum": 3,
                                                                             "maximum": 1}}}, "minimum"),
             ({"type": "json_schema"}, "json_schema"),
             ({"type": "yaml"}, "response_format"),
             ({"type": "json_schema", "json_schema": {"name": "t", "schema": {
                 "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_CHARS // 20)}}}},
              "at most")]
    for response_format, why in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, "response_format": response_format}, timeout=60)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (response_format, r.text)
        assert r.json()["error"]["param"].startswith("response_format"), r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={**base, "ignore_eos": True, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "JSON:", "max_tokens": 40,
                                                              "temperature": 0, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text
