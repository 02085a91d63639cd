"""Anthropic's Messages API request body (`POST /v1/messages`), as pydantic models.

What this server does not serve is refused, not ignored: every model forbids keys it does
not list, so `thinking`, `mcp_servers`, an `image` block or a server tool is a 400 that
names it. `cache_control` is accepted where Anthropic's clients put it and changes nothing:
every prompt's prefix is cached here (apart per tenant) whether or not a client marks it.
A string `system`, message `content` or tool result `content` is one text block.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from gateway.completions.protocol import INT32_MAX, MAX_STOP_CHARS, MAX_STOP_STRINGS
from gateway.completions.tools import MAX_TOOLS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = Field(None, max_length=0)  # a reply's block sent back as it came: none


def _as_blocks(value):
    """A string where blocks may come: one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


TextBlocks = Annotated[list[TextBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[TextBlock])]


class ToolUseBlock(_Strict):
    """An assistant's earlier call (a reply's tool_use block, sent back in the history)."""
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """What a call returned, in the user's next message; `tool_use_id` names the call."""
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: TextBlocks = Field(default_factory=list)
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The result as the chat template gets it; an error says it is one."""
        text = "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[ContentBlock])]


class ToolSpec(_Strict):
    """A client tool: its name, what it does, and the JSON schema of its input."""
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash, ...) are not served
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict
    strict: bool | None = None  # the input follows the schema exactly (the grammar's strict mode)
    cache_control: CacheControl | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(_Strict):
    """The body of `POST /v1/messages`; gateway/messages/request.py makes it a chat request."""
    model: str
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    messages: list[InputMessage] = Field(min_length=1)
    system: TextBlocks | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)  # 0: no truncation
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        if any(not s for s in v or ()):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in v or ()):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return v
