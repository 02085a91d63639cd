"""What a request asks its output to follow: a JSON schema (`Grammar`), checked for size
when made; compiling it into a token-level grammar is the engine's (engine/grammar.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SCHEMA_CHARS = 64 * 1024  # a bound on what one request may ask the compiler to build


class GrammarError(ValueError):
    """The schema cannot constrain an output: the message says what is wrong with it."""


@dataclass(frozen=True)
class Grammar:
    """A JSON schema the output must follow. strict: properties the schema does not name are
    refused unless it allows them (OpenAI's `strict: true`); otherwise JSON Schema's own
    default (allowed) holds. `{"type": "object"}` is OpenAI's json_object mode."""

    json_schema: str
    strict: bool = True
    # Its compiled form, once Grammars.compile made it for this request (not part of its
    # identity): the matcher is made from it, never from the cache, which may have dropped it.
    compiled: object = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"schema is {len(self.json_schema)} characters; at most {MAX_SCHEMA_CHARS} are served")


JSON_OBJECT = Grammar('{"type": "object"}', strict=False)
