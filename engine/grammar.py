"""Structured output: a JSON schema a request's output must follow, compiled once per
schema into a token-level grammar (xgrammar), and one matcher per request that says which
tokens may come next.

    grammars = Grammars.from_folder(model_path, vocab_size, stop_token_ids)  # one per process
    grammars.compile(grammar, source)  # cached per schema, kept on `grammar`; GrammarError if bad
    matcher = grammars.matcher(grammar)  # one per sequence: the compiled grammar kept on `grammar`
    rows, allowed = allowed_next(matchers, outputs, vocab)  # before each sampled step: [rows, vocab] bool

A matcher follows the request's output tokens rather than owning them: before each fill it
accepts the tokens it has not seen yet. So the first token sampled on a prefill worker, a
recompute after preemption and a retried prefill need nothing of their own: the decode
worker's matcher catches up from `output_token_ids`.

The grammar's stop tokens are the model's EOS ids: once the JSON is complete only they are
allowed, and the scheduler ends the request on the EOS as on any other.

Compiles run on their own thread, one at a time, each schema once, tenants in turn, with a
bounded number of callers waiting (engine/cached_compiler.py). Each may cost at most
COMPILE_BUDGET_REFS compiles of a reference schema, timed on this process at start: a
stated cost, the same on a slow host as on a fast one. The compiled grammar is kept on the
request's `Grammar`, so admission on the engine loop never compiles, even when the cache
dropped it in between.

xgrammar (and with it torch) is imported on first use, about a second: a process that
never serves a schema never loads it, and the gateway, which only reads `Grammar`, never does.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.grammar_spec import Grammar, GrammarError
from engine.cached_compiler import CachedCompiler, Overdue

if TYPE_CHECKING:  # torch and xgrammar load on first use: the gateway imports this module for Grammar alone
    import torch

log = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars (and refused schemas) kept per process, least recently used dropped
MAX_COMPILE_WAITERS = 256  # callers waiting for compiles, where the engine's queue sets no bound
# What one schema may cost to compile, in compiles of REFERENCE_SCHEMA timed on this process:
# typical schemas cost under one; a wide schema of patterns (40 fields) about eight.
COMPILE_BUDGET_REFS = 200
REFERENCE_SCHEMA = json.dumps({"type": "object", "properties": {
    f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}@[a-z]+\\.(com|org)"} for i in range(5)}})


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
                 add_prefix_space: bool = False, max_waiters: int = MAX_COMPILE_WAITERS,
                 budget_s: float | None = None) -> None:
        """budget_s: what one compile may take (default: COMPILE_BUDGET_REFS reference compiles,
        timed here); max_waiters: callers that may wait for compiles at once."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo(encoded_vocab, vocab_type=getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids), add_prefix_space=add_prefix_space)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.reference_s = self._time_reference()
        if budget_s is None:
            budget_s = COMPILE_BUDGET_REFS * self.reference_s
        self._compiles: CachedCompiler[Grammar, object] = CachedCompiler(self._build, budget_s, max_waiters,
                                                                         _CACHE_SIZE, name="grammar-compile")
        from importlib.metadata import version

        log.info("grammars: xgrammar %s, %s vocabulary of %d tokens, stop tokens %s; a compile may take %.3gs "
                 "(%d reference compiles of %.3gs)", version("xgrammar"), vocab_type, vocab_size,
                 list(stop_token_ids), budget_s, COMPILE_BUDGET_REFS, self.reference_s)

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int, stop_token_ids: Sequence[int],
                    max_waiters: int = MAX_COMPILE_WAITERS, budget_s: float | None = None) -> Grammars:
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
        return cls(encoded, _vocab_type(spec), size, stop_token_ids, _add_prefix_space(spec), max_waiters, budget_s)

    @property
    def budget_s(self) -> float:
        """What one compile may take on this process."""
        return self._compiles.budget_s

    @property
    def num_waiters(self) -> int:
        """Callers blocked in compile() now."""
        return self._compiles.num_waiters

    @property
    def num_compiles(self) -> int:
        """Compiles begun so far (a cached or shared one counts once)."""
        return self._compiles.num_builds

    def _time_reference(self) -> float:
        """Seconds for one compile of REFERENCE_SCHEMA here: the unit of the budget (the best of
        two, the first also warming the compiler up)."""
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            self._compiler.compile_json_schema(REFERENCE_SCHEMA, any_whitespace=False)
            best = min(best, time.perf_counter() - t0)
        return best

    def compile(self, grammar: Grammar, source: str = "", wait_s: float | None = None, others_waiting: int = 0):
        """The compiled grammar, also kept on `grammar` (for matcher()). Cached per schema; a
        schema queued or compiling for another caller is waited for, not compiled again.
        GrammarError naming what is wrong with the schema, or that its compile ran past the
        budget (then it stays refused while cached); CompilerBusy (cached_compiler.Busy) when
        too many callers wait already (`others_waiting` counted among them; at most half from
        one `source`), or `wait_s` passed before its compile began."""
        try:
            compiled = self._compiles.get(grammar, source, wait_s, others_waiting)
        except Overdue as e:
            raise GrammarError(f"schema did not compile within {e.budget_s:.3g}s ({e.budget_s / self.reference_s:.3g} "
                               f"times a reference schema's compile here); simplify or split it") from None
        object.__setattr__(grammar, "compiled", compiled)  # frozen, but for this one slot
        return compiled

    def _build(self, grammar: Grammar):
        """One compile, on the compile thread."""
        try:
            json.loads(grammar.json_schema)
        except ValueError as e:
            raise GrammarError(f"schema is not valid JSON: {e}") from None
        try:
            return self._compiler.compile_json_schema(grammar.json_schema, any_whitespace=False,
                                                      strict_mode=grammar.strict)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            raise GrammarError(f"unsupported or invalid schema: {_message(e)}") from None

    def matcher(self, grammar: Grammar) -> Matcher:
        """A matcher over the grammar compile() kept on `grammar`; compiled now if it has none
        (offline use, where the caller's thread is the loop: a worker always compiles first)."""
        compiled = grammar.compiled if grammar.compiled is not None else self.compile(grammar)
        return Matcher(self._xgr.GrammarMatcher(compiled), self.vocab_size)


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
