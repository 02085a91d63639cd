"""The OpenAI request bodies the gateway accepts (pydantic), and the engine fields they map to.

Unknown fields are ignored (clients send vendor extras); known fields are range-checked
so a bad value is a 400 that names the field, never an error inside the system.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.completions.tools import Tool, ToolChoice

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # per stop string: what is held back of the text (and searched) is this long at most
MAX_LOGIT_BIAS = 300
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


INT32_MAX = 2**31 - 1  # the proto's int32 fields


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the output must follow."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(default_factory=dict, alias="schema")  # {} or true: any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object (name, schema)")
        return self


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # an int32 on the wire
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # parallel choices: one prefill, the prompt's KV shared
    user: str | None = None
    ignore_eos: bool = False  # vendor extra (vLLM has it too): generate exactly max_tokens, for benchmarks
    # vendor extra (vLLM has it too): prefix-cache hits only among requests with the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, value in v.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # "²" is a digit, not an int
                raise ValueError(f"key {key!r} is not a token id")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"value for token {key} must be in [-100, 100]")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (gateway/completions/tools.py)
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:  # only text parts are supported
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the model's
    chat template, to the token ids a completion would run on."""
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # a prompt's; a chat template writes its own
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids to their text."""
    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[int] = Field(max_length=1 << 20)


class Membership(BaseModel):
    """PUT /admin/workers: the workers the gateway routes to (gRPC host:port each)."""
    model_config = ConfigDict(extra="forbid")

    decode: list[str]
    prefill: list[str] = []
    metrics: str = ""  # the controller's Prometheus exposition, merged into /metrics as role="controller"
    controller: str = "controller"  # its incarnation, the `worker` label of those series
