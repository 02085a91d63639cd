"""Structured output at the gateway: a body's `response_format` as the grammar the workers
sample under, checked by compiling it here first, so that a bad schema is a 400 naming
what is wrong before any worker sees it, and a schema too slow to compile is refused at a
bound instead of holding the request (or a worker) indefinitely.

The compile runs on a small pool of its own, never on the event loop; the grammar is
cached, so the workers' own compile of a schema checked here is the same work once more.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.grammar import JSON_OBJECT, Grammar, GrammarError, Grammars
from gateway.errors import APIError
from gateway.protocol import ResponseFormat

COMPILE_THREADS = 2  # schemas compiled at once; more wait their turn (within their bound)
DEFAULT_COMPILE_TIMEOUT_S = 10.0  # schemas take milliseconds; a bound, not an expectation


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


class GrammarCheck:
    """Compiles each new schema once, off the event loop, within `timeout_s`."""

    def __init__(self, model_path: Path, vocab_size: int, stop_token_ids: list[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._args = (model_path, vocab_size, stop_token_ids)
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self.timeout_s = timeout_s

    def _compile(self, grammar: Grammar) -> None:
        with self._lock:
            if self._grammars is None:  # first schema: xgrammar loads (about a second), once
                self._grammars = Grammars.from_folder(*self._args)
        self._grammars.compile(grammar)

    async def check(self, grammar: Grammar, param: str = "response_format") -> None:
        """APIError 400 naming what is wrong, or that the schema did not compile in time."""
        compiling = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, grammar)
        try:
            await asyncio.wait_for(asyncio.shield(compiling), self.timeout_s)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        except TimeoutError:
            raise APIError(400, f"{param}: the schema did not compile within {self.timeout_s:g}s; "
                                "simplify it or split it", param) from None
