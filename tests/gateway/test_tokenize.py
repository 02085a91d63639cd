"""/tokenize and /detokenize in vLLM's shapes, checked against transformers' tokenizer of the
same folder: a prompt, a chat rendered with its template, token strings, and text back."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.gateway_procs import CHAT


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_a_prompt_tokenizes_as_transformers_does(system, hf):
    url = system[0]
    prompt = "The capital of France is Paris. Ünïcödé and emoji 🙂 too."
    r = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf(prompt).input_ids
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] > 0
    assert body["token_strs"] == hf.convert_ids_to_tokens(expected)


def test_a_chat_tokenizes_with_its_template_as_transformers_does(system, hf):
    url = system[0]
    for gen in (True, False):
        r = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "messages": CHAT, "add_generation_prompt": gen})
        assert r.status_code == 200, r.text
        text = hf.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        expected = hf(text, add_special_tokens=False).input_ids
        assert r.json()["tokens"] == expected and r.json()["token_strs"] is None


def test_tokens_detokenize_as_transformers_does(system, hf):
    url = system[0]
    ids = hf("Tokens back to text: ça marche, 🙂.").input_ids
    r = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf.decode(ids, skip_special_tokens=True)}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "smollm2"}, 400, None),  # neither prompt nor messages
    ("/tokenize", {"model": "smollm2", "prompt": "a", "messages": CHAT}, 400, None),  # both
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": "smollm2", "tokens": [0, -1]}, 400, "tokens"),
    ("/detokenize", {"model": "smollm2", "tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"model": "smollm2", "tokens": "abc"}, 400, None),
])
def test_bad_input_is_a_400_with_a_json_body(system, path, body, status, param):
    r = httpx.post(f"{system[0]}{path}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
