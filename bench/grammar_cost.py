"""What structured output costs, and why xgrammar: in one run, on the host at hand.

    python -m bench.grammar_cost [--dtype auto] [--steps 12] [--json out.json]

1. The grammar engines side by side on SmolLM2's vocabulary (49152 tokens): the time to
   compile each schema of a set (nested objects, arrays, enums, bounded numbers, a 20-field
   object), and the time to fill the next-token masks of 1 and 32 requests in the middle of
   a document (in a short string and in a long one). xgrammar (what pdserve uses) always; llguidance and outlines-core when they
   are installed (`pip install llguidance outlines-core`: neither is a dependency).
2. The engine: a decode step at batch 1 and 32 with every request under a JSON schema,
   beside the same batch unconstrained, alternated in the same run (ms/step and ratio).
The host's ISA is printed beside every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.cpu_attention import median_seconds
from common.grammar_spec import Grammar
from common.model_source import resolve_model
from common.sampling_params import SamplingParams
from engine.config import ModelConfig
from engine.grammar import Grammars, allowed_next
from engine.llm import LLM
from kernels.host import cpu

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"]}, "active": {"type": "boolean"}}, "required": ["person", "active"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bounds": {"type": "object", "properties": {"t": {"type": "number", "minimum": -5.5, "maximum": 40}},
               "required": ["t"]},
    "wide": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                              for i in range(20)}},
}
# Where the masks are filled: inside a short string value of `nested` (most tokens allowed),
# and inside a long free-text one.
STORY = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 400}}, "required": ["story"]}
PLACES = {"short string": (SCHEMAS["nested"], '{"person": {"name": "Ann Lee'),
          "long string": (STORY, '{"story": "Once upon a time there was')}


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _median_ms(fn) -> float:
    return median_seconds(fn, repeat=20) * 1e3


def _xgrammar(folder, vocab_size: int, eos: list[int], prefixes: dict) -> dict:
    grammars = Grammars.from_folder(folder, vocab_size, eos)
    out = {"compile_ms": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammars.compile(Grammar(json.dumps(schema)))
        out["compile_ms"][name] = (time.perf_counter() - t0) * 1e3
    for place, (schema, prefix) in prefixes.items():
        grammar = Grammar(json.dumps(schema))
        for batch in (1, 32):
            matchers = [grammars.matcher(grammar) for _ in range(batch)]
            allowed_next(matchers, [prefix] * batch, vocab_size)  # each matcher at the document's place
            bitmask = torch.full((batch, -(-vocab_size // 32)), -1, dtype=torch.int32)

            def fill():
                for i, m in enumerate(matchers):
                    m.fill(prefix, bitmask, i)
            out[f"fill_ms_{place}_batch{batch}"] = _median_ms(fill)
            if place == "short string":  # the fill, plus unpacking into the sampler's bool mask
                out[f"mask_ms_batch{batch}"] = _median_ms(lambda: allowed_next(matchers, [prefix] * batch, vocab_size))
    return out


def _llguidance(folder, vocab_size: int, prefixes: dict) -> dict | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    tok = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")),
                                       n_vocab=vocab_size)
    out = {"compile_ms": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        out["compile_ms"][name] = (time.perf_counter() - t0) * 1e3
        if m.is_error():
            out["compile_ms"][name] = f"error: {m.get_error()}"
    for place, (schema, prefix) in prefixes.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        for batch in (1, 32):
            matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
            for m in matchers:
                m.consume_tokens(prefix)
            mask = llguidance.torch.allocate_token_bitmask(batch, vocab_size)

            def fill():
                for i, m in enumerate(matchers):
                    llguidance.torch.fill_next_token_bitmask(m, mask, i)
            out[f"fill_ms_{place}_batch{batch}"] = _median_ms(fill)
    return out


def _outlines(folder, vocab_size: int, eos: int, prefixes: dict) -> dict | None:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    vocab: dict[str, list[int]] = {}
    for token_id in range(len(hf)):
        if token_id != eos:
            text = hf.convert_tokens_to_string([hf.convert_ids_to_tokens(token_id)])
            vocab.setdefault(text, []).append(token_id)
    vocabulary = Vocabulary(eos, vocab)
    out = {"compile_ms": {}}
    indexes = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            indexes[name] = Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
            out["compile_ms"][name] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 (a schema it does not take is a finding)
            out["compile_ms"][name] = f"error: {e}"[:120]
    indexes["long string"] = Index(build_regex_from_schema(json.dumps(STORY)), vocabulary)
    for place, (_, prefix) in prefixes.items():
        index = indexes.get("nested" if place == "short string" else place)
        if index is None:
            continue
        for batch in (1, 32):
            guides = [Guide(index) for _ in range(batch)]
            for g in guides:
                for t in prefix:
                    g.advance(t)

            def fill():
                for g in guides:
                    torch.tensor(g.get_tokens(), dtype=torch.int64)  # the allowed ids, as a mask needs them
            out[f"fill_ms_{place}_batch{batch}"] = _median_ms(fill)
    return out


def _engine_steps(llm: LLM, batch: int, grammar: Grammar | None, steps: int) -> float:
    """Median decode step (ms) over `steps` steps of `batch` requests, after their prefill."""
    engine = llm.engine
    prompt = llm.chat_prompt_ids([{"role": "user", "content": "Describe a person as JSON."}])
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 400}},
              "required": ["story"]}  # long enough that no row ends inside the timed steps
    params = SamplingParams(temperature=0.8, max_tokens=steps + 8,
                            grammar=Grammar(json.dumps(schema)) if grammar else None,
                            ignore_eos=grammar is None)
    ids = {f"g{batch}-{grammar is not None}-{i}" for i in range(batch)}
    for rid in ids:
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while started != ids:  # every prompt prefilled (each has its first token)
        started |= {out.request_id for out in engine.step() if out.token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    host = cpu().describe()
    folder = resolve_model("smollm2")
    llm = LLM("smollm2", dtype=args.dtype)
    cfg = ModelConfig.from_pretrained(folder)
    prefix = {place: (schema, llm.tokenizer.encode(text, add_special_tokens=False))
              for place, (schema, text) in PLACES.items()}
    _say(f"grammar engines on {host}")
    engines = {"xgrammar": _xgrammar(folder, cfg.vocab_size, list(cfg.eos_token_ids), prefix),
               "llguidance": _llguidance(folder, cfg.vocab_size, prefix),
               "outlines-core": _outlines(folder, cfg.vocab_size, cfg.eos_token_ids[0], prefix)}
    for name, figures in engines.items():
        print(f"{name:14s} " + ("not installed" if figures is None else json.dumps(figures, default=str)))
    _say("engine decode steps, constrained and not, alternated")
    grammar = Grammar("{}")
    steps = {}
    for batch in (1, 32):
        plain, constrained = [], []
        for _ in range(2):
            plain.append(_engine_steps(llm, batch, None, args.steps))
            constrained.append(_engine_steps(llm, batch, grammar, args.steps))
        p, c = min(plain), min(constrained)
        steps[batch] = {"plain_ms": p, "grammar_ms": c, "ratio": c / p}
        print(f"decode step batch {batch:2d}: unconstrained {p:6.1f} ms, under a JSON schema {c:6.1f} ms "
              f"({c / p:.3f}x)  [{host}; {llm.dtype_choice}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host, "dtype": llm.dtype_choice, "engines": engines, "decode_steps": steps}, f,
                      indent=2, default=str)


if __name__ == "__main__":
    main()
