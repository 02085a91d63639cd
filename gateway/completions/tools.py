"""Tool calls in the chat API: what `tools` and `tool_choice` ask of the generation, and the
answer's `tool_calls`.

    plan = ToolPlan.of(body, template_renders_tools)   # None: no tools, or tool_choice "none"
    plan.grammar                    # the output is constrained to a call (required / named)
    plan.calls(text)                # the generated text as OpenAI's tool_calls

- a named function: the output is that function's arguments, generated under a grammar of
  its parameters' schema;
- "required": the output is a JSON array of one or more {"name", "parameters"} objects,
  each under its function's schema (one at most with parallel_tool_calls false);
- "auto": the chat template is given the tools and the model decides; a call comes back in
  the Hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, what the
  templates of Qwen, Hermes and most tool-trained models teach), anything else is content.
  A template that does not render tools cannot offer them: "auto" is a 400 there;
- "none": no call; the tools are not shown to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.grammar_spec import Grammar, GrammarError
from gateway.errors import APIError

MAX_TOOLS = 128


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools. `render`: the tools as the chat template gets them."""

    mode: Literal["auto", "required", "named"]
    functions: dict[str, FunctionSpec]
    grammar: Grammar | None
    render: list[dict] | None

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
           template_renders_tools: bool) -> ToolPlan | None:
        """None when nothing changes for tools; APIError 400 naming what cannot be served."""
        if not tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        if len(tools) > MAX_TOOLS:
            raise APIError(400, f"at most {MAX_TOOLS} tools", "tools")
        functions = {t.function.name: t.function for t in tools}
        if len(functions) != len(tools):
            raise APIError(400, "tool function names must be unique", "tools")
        choice = choice or "auto"
        if choice == "none":
            return None
        render = [t.model_dump(exclude_none=True) for t in tools] if template_renders_tools else None
        if choice == "auto":
            if not template_renders_tools:
                raise APIError(400, 'tool_choice "auto" needs a chat template that shows the model its tools, '
                                    'and this model\'s does not: use "required", a named function, or "none"',
                               "tool_choice")
            return cls("auto", functions, None, render)
        if isinstance(choice, NamedToolChoice):
            spec = functions.get(choice.function.name)
            if spec is None:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                               "tool_choice")
            return cls("named", {spec.name: spec}, _grammar(spec.parameters, spec.strict), render)
        one_of = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                   "required": ["name", "parameters"], "additionalProperties": False} for f in functions.values()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if parallel is False:
            schema["maxItems"] = 1
        return cls("required", functions, _grammar(schema, any(f.strict for f in functions.values())), render)

    def calls(self, text: str) -> tuple[list[dict] | None, str | None]:
        """(tool_calls, content) of a finished generation: the calls it made, and the text
        left over (None when all of it was calls). Text that is not a whole call (cut by
        max_tokens) stays content."""
        if self.mode == "named":
            (name,) = self.functions
            return ([_call(name, text)], None) if _parses(text) else (None, text)
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return None, text
            return [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items], None
        calls = []
        for block in _HERMES.findall(text):
            try:
                item = json.loads(block)
            except ValueError:
                continue
            if isinstance(item, dict) and item.get("name") in self.functions:
                calls.append(_call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
        if not calls:
            return None, text
        rest = _HERMES.sub("", text).strip()
        return calls, rest or None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _grammar(schema: dict, strict: bool | None) -> Grammar:
    try:
        return Grammar(json.dumps(schema), strict=bool(strict))
    except GrammarError as e:
        raise APIError(400, f"tools: {e}", "tools") from None


def render_messages(messages: list, template_renders_tools: bool) -> list[dict]:
    """The conversation for the chat template: an assistant's earlier tool_calls and the
    tool results answer them. A template that knows tools gets them as they are; one that
    does not gets the calls as the assistant's JSON text (the tool results keep role "tool")."""
    out = []
    for m in messages:
        msg = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if template_renders_tools:
                msg["tool_calls"] = m.tool_calls
            else:
                calls = [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
                         for c in m.tool_calls]
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + json.dumps(calls)
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out
