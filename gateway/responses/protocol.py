"""OpenAI's Responses API request body (`POST /v1/responses`), as pydantic models.

What this server does not serve is refused, not ignored: every model forbids keys it does
not list, so an unknown field, an `input_image` part or an `item_reference` is a 400 that
names it. A few fields OpenAI's clients send are listed so that their refusal says why
(gateway/responses/request.py): `reasoning`, `background`, `include`,
`conversation` and a built-in tool (`web_search`, `file_search`, ...).

`input` may be a string (one user message) or a list of items: messages (a role and a
string or text parts; a message with no `type` is one, as OpenAI's "easy" form has it), an
earlier `function_call` and its `function_call_output`. An item the server sent back in an
answer (`response.output`) may be sent as it came: its `id`, `status`, `annotations` and
`logprobs` are taken and change nothing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from gateway.completions.protocol import INT32_MAX
from gateway.completions.tools import MAX_TOOLS

MAX_METADATA_PAIRS = 16  # OpenAI's bound: 16 pairs, keys up to 64 characters, values up to 512
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An assistant's text, as an answer's message carried it."""
    type: Literal["output_text"]
    text: str
    annotations: list = Field(default_factory=list, max_length=0)  # none are made here
    logprobs: list | None = None


TextPart = Annotated[InputText | OutputText, Field(discriminator="type")]


def _as_parts(value):
    """A string where text parts may come: one part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _as_items(value):
    """A string where input items may come: one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class Message(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[TextPart], BeforeValidator(_as_parts, json_schema_input_type=str | list[TextPart])]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCall(_Strict):
    """A call the model made earlier (an answer's `function_call` item, sent back)."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(_Strict):
    """What a call returned; `call_id` names the call."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Annotated[list[InputText], BeforeValidator(_as_parts, json_schema_input_type=str | list[InputText])]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.output)


def _item_type(value) -> str | None:
    """An input item's kind; a message may leave out its `type` (OpenAI's easy input form)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[Message, Tag("message")] | Annotated[FunctionCall, Tag("function_call")]
                      | Annotated[FunctionCallOutput, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="an input item is a message, a function_call or a "
                                                         "function_call_output (no other type is served)")]


class FunctionTool(_Strict):
    """A client function, in the Responses API's flat shape. `strict` is true unless said
    otherwise (OpenAI's default here): arguments name only the properties the schema does."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = True


class BuiltInTool(BaseModel):
    """A tool OpenAI runs itself (web_search, file_search, ...): none is served here; taken
    only so that its refusal names it."""
    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "built_in"


ToolSpec = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[BuiltInTool, Tag("built_in")],
                     Discriminator(_tool_kind)]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON following a schema (`name` and
    `schema` given, as OpenAI asks)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model writes as it writes: only the default is served


class ResponsesRequest(_Strict):
    """The body of `POST /v1/responses`; gateway/responses/request.py makes it a chat request."""
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem])]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)  # vendor extra, as the chat API's
    text: TextConfig | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=MAX_METADATA_PAIRS)  # echoed back
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled"] | None = None  # "auto" (drop old items to fit) is not served
    # Refused with a reason when set (gateway/responses/request.py):
    reasoning: dict | None = None
    background: bool | None = None
    include: list[str] | None = None
    conversation: str | dict | None = None
