"""Structured output: a JSON schema a request's output must follow, compiled once per
schema into a token-level grammar (xgrammar), and one matcher per request that says which
tokens may come next.

    grammars = Grammars.from_folder(model_path, vocab_size, stop_token_ids)  # one per process
    compiled = grammars.compile(Grammar(schema_text))  # cached per schema; GrammarError if bad
    matcher = grammars.matcher(Grammar(schema_text))   # one per sequence
    rows, allowed = allowed_next(matchers, outputs, vocab)  # before each sampled step: [rows, vocab] bool

A matcher follows the request's output tokens rather than owning them: before each fill it
accepts the tokens it has not seen yet. So the first token sampled on a prefill worker, a
recompute after preemption and a retried prefill need nothing of their own: the decode
worker's matcher catches up from `output_token_ids`.

The grammar's stop tokens are the model's EOS ids: once the JSON is complete only they are
allowed, and the scheduler ends the request on the EOS as on any other.

xgrammar (and with it torch) is imported on first use, about a second: a process that
never serves a schema never loads it, and the gateway, which only reads `Grammar`, never does.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and xgrammar load on first use: the gateway imports this module for Grammar alone
    import torch

log = logging.getLogger(__name__)

MAX_SCHEMA_CHARS = 64 * 1024  # a bound on what one request may ask the compiler to build
_CACHE_SIZE = 256  # compiled grammars kept per process (least recently used dropped)
COMPILE_TIMEOUT_S = 10.0  # schemas take milliseconds: a bound on a pathological one, not an expectation


class GrammarError(ValueError):
    """The schema cannot constrain an output: the message says what is wrong with it."""


@dataclass(frozen=True)
class Grammar:
    """A JSON schema the output must follow. strict: properties the schema does not name are
    refused unless it allows them (OpenAI's `strict: true`); otherwise JSON Schema's own
    default (allowed) holds. `{"type": "object"}` is OpenAI's json_object mode."""

    json_schema: str
    strict: bool = True

    def __post_init__(self) -> None:
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"schema is {len(self.json_schema)} characters; at most {MAX_SCHEMA_CHARS} are served")


JSON_OBJECT = Grammar('{"type": "object"}', strict=False)


def _vocab_type(tokenizer_json: dict) -> str:
    """How the tokenizer spells bytes in its vocabulary (xgrammar's VocabType name):
    GPT-2 style byte-level, SentencePiece byte fallback (<0x0A>), or raw strings."""
    decoder = tokenizer_json.get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [])] if decoder.get("type") == "Sequence" else [
        decoder.get("type")]
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK"
    return "RAW"


def _add_prefix_space(tokenizer_json: dict) -> bool:
    """SentencePiece-style tokenizers that prepend a space to the text (Metaspace "always")."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    normalizer = json.dumps(tokenizer_json.get("normalizer") or {})
    return any(s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") == "always" for s in steps) \
        or '"Prepend"' in normalizer


_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(error\.empty\(\)\) is false: )?")


def _message(e: Exception) -> str:
    """xgrammar's error without its source location."""
    return _NOISE.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


class Matcher:
    """One request's place in its grammar, kept in step with its output tokens."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size  # the grammar's: the words of its bitmask rows
        self._seen = 0  # output tokens accepted so far
        self.broken = False  # a token the grammar refused reached the output: left unconstrained

    def fill(self, output_token_ids: Sequence[int], bitmask: "torch.Tensor", row: int) -> bool:
        """Accept the output tokens not seen yet, then write the tokens allowed next into
        `bitmask[row]`. False (and the row left alone) if the grammar refused a token: the
        request then runs unconstrained, which only a bug elsewhere can cause."""
        if self.broken:
            return False
        if len(output_token_ids) < self._seen:  # tokens taken back: step back with them
            self._m.rollback(self._seen - len(output_token_ids))
            self._seen = len(output_token_ids)
        for token in output_token_ids[self._seen:]:
            if not self._m.accept_token(token):
                log.error("grammar refused output token %d at position %d: the request runs unconstrained",
                          token, self._seen)
                self.broken = True
                return False
            self._seen += 1
        self._m.fill_next_token_bitmask(bitmask, row)
        return True


class Grammars:
    """The compiler for one tokenizer and its cache of compiled grammars (thread-safe: RPC
    threads compile while the engine loop makes matchers)."""

    def __init__(self, encoded_vocab: list[str], vocab_type: str, vocab_size: int, stop_token_ids: Sequence[int],
                 add_prefix_space: bool = False) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo(encoded_vocab, vocab_type=getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids), add_prefix_space=add_prefix_space)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[Grammar, object] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        from importlib.metadata import version

        log.info("grammars: xgrammar %s, %s vocabulary of %d tokens, stop tokens %s", version("xgrammar"),
                 vocab_type, vocab_size, list(stop_token_ids))

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int, stop_token_ids: Sequence[int]) -> Grammars:
        """From a Hugging Face folder's tokenizer.json (the `tokenizers` library, not transformers)."""
        from tokenizers import Tokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"structured output needs {path.name} in the model folder, and {folder} has none")
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
        size = max(vocab_size, max(vocab.values()) + 1)
        encoded = [""] * size
        for text, token_id in vocab.items():
            encoded[token_id] = text
        spec = json.loads(path.read_text(encoding="utf-8"))
        return cls(encoded, _vocab_type(spec), size, stop_token_ids, _add_prefix_space(spec))

    def compile(self, grammar: Grammar, timeout_s: float | None = None):
        """The compiled grammar (cached); GrammarError naming what is wrong with the schema,
        or saying it did not compile within `timeout_s` (the compile goes on in the
        background, into the cache, on one of two threads: it cannot be interrupted)."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        if timeout_s is not None:
            try:
                return self._pool.submit(self.compile, grammar).result(timeout_s)
            except FutureTimeout:
                raise GrammarError(f"schema did not compile within {timeout_s:g}s; simplify or split it") from None
        try:
            json.loads(grammar.json_schema)
        except ValueError as e:
            raise GrammarError(f"schema is not valid JSON: {e}") from None
        try:
            compiled = self._compiler.compile_json_schema(grammar.json_schema, any_whitespace=False,
                                                          strict_mode=grammar.strict)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            raise GrammarError(f"unsupported or invalid schema: {_message(e)}") from None
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self._xgr.GrammarMatcher(self.compile(grammar)), self.vocab_size)


def allowed_next(matchers: list[Matcher], outputs: list[Sequence[int]],
                 vocab_size: int) -> tuple[list[int], "torch.Tensor"] | None:
    """The tokens each matcher allows next, after catching up with its request's output:
    (indices into `matchers` that constrain this step, [len(indices), vocab_size] bool);
    None if none does (a matcher whose grammar refused a token constrains nothing)."""
    import torch

    words = -(-max(m.vocab_size for m in matchers) // 32)
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    rows = [i for i, (m, out) in enumerate(zip(matchers, outputs)) if m.fill(out, bitmask, i)]
    if not rows:
        return None
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]: bit j of word w is token 32w + j
    return rows, bits.view(len(rows), -1)[:, :vocab_size].bool()
