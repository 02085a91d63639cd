"""Grammar compiles cannot be used by one client to stall the others, through the engine the
workers run (SmolLM2's tokenizer and real xgrammar compiles): admission on the engine loop
never compiles, even when the cache dropped the request's grammar in between; identical
schemas asked for at once compile once; a client flooding distinct slow schemas is held to
its share of the waiting room and takes turns with the others; a compile nobody waits for
any more is never started."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from common.grammar_spec import Grammar
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.scheduler import QueueFull

MAX_WAITING = 8  # compile waiters count against it: one client may hold half
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def _slow(tag: str) -> Grammar:
    """A distinct schema that takes many times a small one's compile (40 patterned fields)."""
    return Grammar(json.dumps({"type": "object", "title": tag, "properties": {
        f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}@[a-z]+\\.(com|org)"} for i in range(40)}}))


class _Recorder:
    """xgrammar's own compiler, unchanged, noting each compile's schema and the thread it ran
    on; while `open` is clear, a compile waits for it (callers line up behind it)."""

    def __init__(self, compiler) -> None:
        self._compiler = compiler
        self.calls: list[tuple[str, str]] = []
        self.open = threading.Event()
        self.open.set()

    def compile_json_schema(self, schema: str, **kwargs):
        self.calls.append((schema, threading.current_thread().name))
        self.open.wait()
        return self._compiler.compile_json_schema(schema, **kwargs)


@pytest.fixture
def engine(smollm2_dir):
    engine = LLMEngine.from_folder(smollm2_dir, "float32", CacheConfig(block_size=16, num_blocks=64),
                                   SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                                   max_waiting=MAX_WAITING))
    engine.grammars._compiler = _Recorder(engine.grammars._compiler)
    return engine


def _compiles(engine, grammar: Grammar) -> list[str]:
    """The threads that compiled `grammar`'s schema."""
    return [thread for schema, thread in engine.grammars._compiler.calls if schema == grammar.json_schema]


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """fn(*args) on a thread of its own (a worker's RPC thread); its outcome lands in the list."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fn(*args))
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_admission_never_compiles_a_grammar_the_cache_dropped(engine):
    params = SamplingParams(temperature=0, max_tokens=40, grammar=Grammar(json.dumps(PERSON)))
    thread, outcome = _in_thread(engine.compile_grammar, params)  # the RPC thread
    thread.join()
    assert outcome == [None]
    for i in range(300):  # other requests' schemas push it out of the cache
        engine.compile_grammar(SamplingParams(grammar=Grammar(json.dumps({"type": "integer", "minimum": i}))))
    loop = threading.current_thread().name
    engine.add_request("r", [1, 2, 3], params)
    assert loop not in _compiles(engine, params.grammar)  # compiled once, off the loop
    text = []
    while engine.has_unfinished():
        text += [t for out in engine.step() for t in out.token_ids]
    from tokenizers import Tokenizer

    decoded = Tokenizer.from_file(str(engine.config.model_path / "tokenizer.json")).decode(text)
    jsonschema.validate(json.loads(decoded), PERSON)


def test_identical_schemas_asked_for_at_once_compile_once(engine):
    grammar = _slow("shared")
    start = threading.Barrier(6)

    def ask():
        start.wait()
        return engine.compile_grammar(SamplingParams(grammar=Grammar(grammar.json_schema)))

    calls = [_in_thread(ask) for _ in range(6)]
    for thread, _ in calls:
        thread.join()
    assert [outcome for _, outcome in calls] == [[None]] * 6
    assert len(_compiles(engine, grammar)) == 1


def _until(condition) -> None:
    while not condition():
        threading.Event().wait(0.01)


def test_a_flood_of_slow_schemas_from_one_client_neither_fails_nor_stalls_another(engine):
    compiler = engine.grammars._compiler
    compiler.open.clear()  # the first compile holds the thread until the callers are lined up
    flood = [_slow(f"flood-{i}") for i in range(MAX_WAITING)]
    waiting = [_in_thread(engine.compile_grammar, SamplingParams(grammar=g), "tenant-a") for g in flood[:4]]
    _until(lambda: engine.grammars.num_waiters == 4)  # one compiling, three queued
    with pytest.raises(QueueFull, match="4 schemas of this client.*4 is the limit"):  # half of MAX_WAITING
        engine.compile_grammar(SamplingParams(grammar=flood[4]), "tenant-a")
    # A compile nobody waits for (its caller gave up before its turn) is never started.
    gave_up = Grammar(json.dumps({"type": "array", "items": {"type": "integer"}}))
    with pytest.raises(QueueFull, match="waited 0s for its turn"):
        engine.compile_grammar(SamplingParams(grammar=gave_up), "tenant-c", 0.0)
    other = Grammar(json.dumps(PERSON))
    thread, outcome = _in_thread(engine.compile_grammar, SamplingParams(grammar=other), "tenant-b")
    _until(lambda: engine.grammars.num_waiters == 5)
    compiler.open.set()
    thread.join()
    assert outcome == [None]
    assert [schema for schema, _ in compiler.calls][1] == other.json_schema  # next in turn, not after the flood
    for thread, outcome in waiting:
        thread.join()
        assert outcome == [None]
    assert _compiles(engine, flood[4]) == _compiles(engine, gave_up) == []
    assert engine.grammars.num_waiters == 0
