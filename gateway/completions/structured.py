"""Structured output at the gateway: a body's `response_format` as the grammar the workers
sample under. The gateway only names the grammar (and refuses one too large to serve);
the workers compile it, in their RPC threads before the request reaches the engine loop,
so an invalid or unsupported schema comes back as a 400 that says what is wrong with it,
and one that costs more than engine/grammar.py's compile budget as a 400 too.
The gateway never loads the grammar engine (nor torch, which it brings)."""

from __future__ import annotations

import json

from common.grammar_spec import JSON_OBJECT, Grammar, GrammarError
from gateway.errors import APIError
from gateway.completions.protocol import ResponseFormat


def grammar_of(response_format: ResponseFormat | None) -> Grammar | None:
    """The grammar a response_format asks for; None for text (or none given). APIError 400
    if the schema is too large to serve."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return JSON_OBJECT
    spec = response_format.json_schema
    try:
        return Grammar(json.dumps(spec.schema_), strict=bool(spec.strict))
    except GrammarError as e:
        raise APIError(400, f"response_format: {e}", "response_format") from None
