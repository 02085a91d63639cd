"""A non-streamed answer's logprobs: the same body as rendering every step at the end (which
the official client parses), built as the steps arrive, so building it never holds a second
copy of what the body holds (the workers' messages, a token's text and bytes per place)."""

from __future__ import annotations

import asyncio
import json
import random
import tracemalloc

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from common.tokenizer import Tokenizer
from gateway.completions import answer as completion_answer
from rpc import pdserve_pb2 as pb

STEPS, TOP = 2000, 20  # n=1 at 2000 tokens x 20 alternatives: 42,000 entries, under the 131,072 bound


class _Body:
    echo, prompt = False, "unused"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    tok = Tokenizer.from_pretrained(smollm2_dir)
    tok.decode([42], skip_special_tokens=False)  # its lazy set-up is not the building's
    return tok


def _steps(seed: int) -> list[list[pb.TokenLogprobs]]:
    """Each engine step's logprobs. The token ids follow Zipf's law over the vocabulary, as a
    text's tokens (and a model's alternatives) do: common tokens recur, rare ones are many."""
    rng = random.Random(seed)

    def token() -> int:
        return min(49151, int(rng.paretovariate(1.0)) * 7)

    return [[pb.TokenLogprobs(token_id=token(), logprob=-rng.random(), top_token_ids=[token() for _ in range(TOP)],
                              top_logprobs=[-rng.random() for _ in range(TOP)])] for _ in range(STEPS)]


async def _events(steps: list[list[pb.TokenLogprobs]]):
    """The decode worker's stream of those steps, read one message at a time."""
    for i, step in enumerate(steps):
        yield completion_answer.Text("ab", "length" if i == len(steps) - 1 else None, step)
    yield completion_answer.Usage({"prompt_tokens": 3, "completion_tokens": len(steps), "total_tokens": len(steps) + 3})


def _reference(kind: str, tokenizer: Tokenizer, entries: list[pb.TokenLogprobs]) -> dict:
    """The logprobs object as the gateway rendered it before: every entry at the end."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    if kind == "chat":
        return {"content": [
            {"token": text(e.token_id), "logprob": e.logprob, "bytes": list(tokenizer.token_bytes(e.token_id)),
             "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(tokenizer.token_bytes(t))}
                              for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
            for e in entries]}
    return {"tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)} for e in entries]}


def _dumps(obj) -> bytes:  # as the JSON response renders it
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_body_is_the_one_rendered_at_the_end_and_the_official_client_parses_it(tokenizer, kind):
    steps = _steps(1)
    answer = asyncio.run(completion_answer.collect(kind, _events(steps), "cmpl-1", _Body, "smollm2", tokenizer))
    want = _reference(kind, tokenizer, [e for step in steps for e in step])
    assert _dumps(answer["choices"][0]["logprobs"]) == _dumps(want)
    parsed = (ChatCompletion if kind == "chat" else Completion).model_validate_json(_dumps(answer))
    if kind == "chat":
        assert len(parsed.choices[0].logprobs.content) == STEPS
        assert len(parsed.choices[0].logprobs.content[-1].top_logprobs) == TOP
    else:
        assert len(parsed.choices[0].logprobs.tokens) == STEPS


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_building_the_body_holds_it_about_once(tokenizer, kind):
    """The most memory the building takes, against the body it makes: well under the Python
    objects of every entry rendered apart plus the messages they came from (over 3.1x the
    body before); a bound, not a speed."""
    events = _events(_steps(2))  # the workers' messages exist before: only the building is measured
    tracemalloc.start()
    try:
        answer = asyncio.run(completion_answer.collect(kind, events, "cmpl-1", _Body, "smollm2", tokenizer))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    body = len(_dumps(answer))
    assert peak < 2.75 * body, (peak, body, peak / body)


class _Call:
    """A decode worker's messages for one stream, read one at a time."""

    def __init__(self, messages: list[pb.GenerateResponse]):
        self._rest = iter(messages)

    async def read(self) -> pb.GenerateResponse:
        return next(self._rest)


class _Plain:
    stop: list[str] = []


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_token_whose_text_is_held_back_keeps_its_logprobs(tokenizer, kind):
    """An emoji is three byte tokens: the first two decode to no text yet (the detokenizer
    holds them back), and their steps' logprobs must still reach the answer: one entry per
    token, as the official client counts them, each with the bytes it stands for."""
    ids = tokenizer.encode("😀 ok", add_special_tokens=False)
    assert len(tokenizer.encode("😀", add_special_tokens=False)) == 3  # the case this is about
    steps = [pb.GenerateResponse(token_ids=[t], logprobs=[pb.TokenLogprobs(
        token_id=t, logprob=-0.5, top_token_ids=[t, 42], top_logprobs=[-0.5, -2.0])]) for t in ids]
    steps[-1].finish_reason = pb.LENGTH
    call = _Call(steps[1:])
    events = completion_answer.generate_events(kind, _Plain, "cmpl-1", call, steps[0], 3, 0.0, 0.0, "completions",
                                               tokenizer)
    answer = asyncio.run(completion_answer.collect(kind, events, "cmpl-1", _Body, "smollm2", tokenizer))
    parsed = (ChatCompletion if kind == "chat" else Completion).model_validate_json(_dumps(answer))
    logprobs = parsed.choices[0].logprobs
    assert len(logprobs.content if kind == "chat" else logprobs.tokens) == len(ids)
    text = parsed.choices[0].message.content if kind == "chat" else parsed.choices[0].text
    assert text == "😀 ok"
    if kind == "chat":  # each byte token's own bytes, which join back into the character
        assert bytes(b for entry in logprobs.content[:3] for b in entry.bytes) == "😀".encode()
        assert logprobs.content[3].bytes == list(b" ok")
