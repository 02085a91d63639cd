"""Tokenizer: encode / decode / chat rendering equal transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Café, naïve façade, Ångström, ñandú",
    "你好，世界！日本語のテキストです。",
    "Emoji: 🙂🎉👍🏽 👨‍👩‍👧 🇫🇷",
    "Numbers 2024 and 3.14159, code: def f(x): return x**2",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Réponds en français 🏴‍☠️."},
        {"role": "user", "content": "Bonjour !"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫."},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text, add_special_tokens):
    expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_each_tokens_bytes_join_back_into_the_text(tokenizer, text):
    """OpenAI's logprobs `bytes`: a token that is part of a character (an emoji's, a CJK
    character's) has that part's bytes, not the U+FFFD its text alone decodes to."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, text, skip_special_tokens):
    ids = hf_tokenizer.encode(text) + [2]  # end with <|im_end|>
    expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert tokenizer.encode(prompt, add_special_tokens=False) == list(expected_ids)


def test_special_ids_follow_platform_facts(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token_id == 1  # <|im_start|>
    assert tokenizer.eos_token_ids == frozenset({2})  # <|im_end|>
    assert tokenizer.vocab_size == 49152 == len(hf_tokenizer)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def _folder_with(tmp_path: Path, smollm2_dir: Path, config: dict, template_file: str | None = None) -> Path:
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_template_helpers_match_transformers(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}\n"
        "{% endfor %}count={{ ns.n }} year={{ strftime_now('%Y') }}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
              "chat_template": template}
    folder = _folder_with(tmp_path, smollm2_dir, config)
    messages = [{"role": "user", "content": "é <b>&</b> 🙂", "name": None},
                {"role": "skip", "content": "x"}, {"role": "assistant", "content": "ok"}]
    ours = Tokenizer.from_pretrained(folder).apply_chat_template(messages)
    assert ours == AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert '"content": "é <b>&</b> 🙂"' in ours and '"name"' not in ours


def test_template_raise_exception_is_a_chat_template_error(tmp_path, smollm2_dir):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    )
    folder = _folder_with(tmp_path, smollm2_dir, {}, template_file=template)
    tok = Tokenizer.from_pretrained(folder)
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_missing_chat_template_is_a_clear_error(tmp_path, smollm2_dir):
    tok = Tokenizer.from_pretrained(_folder_with(tmp_path, smollm2_dir, {"eos_token": "<|im_end|>"}))
    assert tok.encode("hi") == [6004]
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, ValueError)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_config_add_bos_token_prepends_bos_once(tmp_path, smollm2_dir):
    config = {"bos_token": "<|im_start|>", "add_bos_token": True}
    tok = Tokenizer.from_pretrained(_folder_with(tmp_path, smollm2_dir, config))
    plain = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [1, *plain]


def test_generation_config_adds_eos_ids(tmp_path, smollm2_dir):
    folder = _folder_with(tmp_path, smollm2_dir, {"eos_token": "<|im_end|>"})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({0, 2})
