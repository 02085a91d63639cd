"""`n` > 1 with the official `openai` client on the 1P+1D deployment: one prefill (the
prompt's KV crosses once; the other choices find it in the decode worker's prefix cache),
`index` per choice streamed and not, the prompt counted once in the usage; choice 0 of a
seeded request is the n = 1 answer, greedy choices agree."""

from __future__ import annotations

import pytest

from tests.worker_procs import wait_idle


def _moved(decode) -> int:
    return decode.stats().kv_blocks_transferred


def test_n_choices_share_one_prefill_and_count_the_prompt_once(system, client):
    _, _, decode = system
    story = "Once upon a time, in a quiet harbour town by the sea, there lived an old sailor. " * 4

    def ask(n: int, tag: str):
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": f"{tag} {story}"}],
                                              n=n, temperature=1.0, seed=11, max_tokens=8,
                                              extra_body={"ignore_eos": True})
    one = ask(1, "A")  # and the chat template's system prompt is in the prefix caches from now on
    before = _moved(decode)
    ask(1, "B")
    per_prefill = _moved(decode) - before
    assert per_prefill > 0  # the prompt is long enough to be prefilled remotely
    before = _moved(decode)
    three = ask(3, "C")
    assert _moved(decode) - before == per_prefill  # one prefill for the three choices, not three
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 24
    assert len({c.message.content for c in three.choices}) > 1  # each choice samples its own tokens
    again = ask(3, "A")  # the prompt of `one`: choice 0 samples with the request's seed, as n = 1 did
    assert again.choices[0].message.content == one.choices[0].message.content
    wait_idle(decode)  # every choice's blocks back


def test_streamed_choices_carry_their_index_and_one_usage(client):
    stream = client.completions.create(model="smollm2", prompt="The harbour at dawn", n=2, max_tokens=6,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    usage = [c.usage for c in chunks if c.usage]
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]  # greedy choices agree
    assert len(usage) == 1 and usage[0].completion_tokens == 12


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_400(client, n):
    import openai

    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="smollm2", prompt="hi", n=n, max_tokens=2)
