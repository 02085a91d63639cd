"""gateway/text_stream.py: stop strings against a plain reference (the first occurrence of
any stop string in the whole decoded text), over the real SmolLM2 tokenizer, whatever the
token boundaries; and the bound on a stop string's length that keeps the search cheap."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from common.tokenizer import Tokenizer
from gateway.completions.protocol import MAX_STOP_CHARS, CompletionRequest
from gateway.text_stream import TextStream

TEXT = ("The sea is wide and the ships are many. A sailor said: the end is near, the end! "
        "Überall Wasser — 海 — and the end came at last. ") * 3


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def _reference(text: str, stops: list[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


@pytest.mark.parametrize("seed", range(40))
def test_stops_are_found_wherever_the_token_boundaries_fall(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = tokenizer.decode(ids)
    start = rng.randrange(len(full) - 40)
    stops = [full[start:start + rng.randint(1, 30)], "never appears " * rng.randint(1, 20)]
    rng.shuffle(stops)
    stream, sent, i = TextStream(tokenizer, stops), [], 0
    while i < len(ids) and not stream.stopped:
        n = rng.randint(1, 4)  # tokens per step, as a step delivers them
        sent.append(stream.push(ids[i:i + n]))
        i += n
    sent.append(stream.finish())
    assert "".join(sent) == _reference(full, stops)
    assert stream.stopped


def test_with_no_stop_everything_is_sent_as_it_comes(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tokenizer, [])
    parts = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(parts) == tokenizer.decode(ids) and not stream.stopped


def test_a_stop_string_is_bounded_in_length():
    body = {"model": "m", "prompt": "hi"}
    CompletionRequest(**body, stop=["x" * MAX_STOP_CHARS])
    with pytest.raises(ValidationError, match=f"at most {MAX_STOP_CHARS} characters"):
        CompletionRequest(**body, stop=["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValidationError, match="at most"):
        CompletionRequest(**body, stop="y" * 60_000)
