"""`n` > 1 with the official `openai` client on the 1P+1D deployment: one prefill (the
prompt's KV crosses once; the other choices find it in the decode worker's prefix cache),
`index` per choice streamed and not, the prompt counted once in the usage; choice 0 of a
seeded request is the n = 1 answer, greedy choices agree."""

from __future__ import annotations

import pytest

from bench.harness.worker_procs import wait_idle


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


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_choice_answers_an_error_and_gives_back_the_tenants_slot(smollm2_dir, tmp_path, stream):
    """n = 2 on the only decode worker, which is killed once the choices' first tokens reached
    the gateway (no worker left to replay on): not streamed, a JSON error; streamed, an
    error event and [DONE]. Either way
    tenant a's slot (2 sequences at most) is given back: its next request is refused for
    want of a worker (503), not for a slot it would never get back (429 for good)."""
    import concurrent.futures
    import json

    import httpx

    from bench.harness.gateway_procs import gateway
    from bench.harness.worker_procs import start_workers, wait_until

    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "a", "api_keys": ["key-a"], "max_concurrent": 2}]}))
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [decode.address], [], tmp_path / "gateway.log",
                     "--tenants", str(tmp_path / "tenants.json")) as url:
            head = {"authorization": "Bearer key-a"}
            body = {"model": "smollm2", "prompt": "Tell me a long story.", "n": 2, "max_tokens": 400,
                    "ignore_eos": True, "stream": stream}

            def ask() -> httpx.Response:
                return httpx.post(f"{url}/v1/completions", json=body, headers=head, timeout=120)

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(ask)
                log = tmp_path / "gateway.log"  # its trace: the choices' first tokens reached the gateway
                wait_until(lambda: answer.done() or '"event":"first_token"' in log.read_text(), 60, "the first tokens")
                assert not answer.done(), answer.result().text
                decode.kill()
                r = answer.result()
            if stream:
                assert r.status_code == 200
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
            else:
                assert r.status_code in (502, 503) and r.headers["content-type"].startswith("application/json")
                assert r.json()["error"]["message"], r.text
            after = httpx.post(f"{url}/v1/completions", headers=head, timeout=60,
                               json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
            assert after.status_code == 503, after.text  # no worker; the tenant's slot is free
            assert "Traceback" not in (tmp_path / "gateway.log").read_text()
    finally:
        decode.stop()
