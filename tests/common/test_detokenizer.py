"""IncrementalDetokenizer: streamed text equals the full decode and never shows half a character."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer

# Emoji and CJK mostly take several byte-level tokens per character in this vocabulary.
EXTRA_PIECES = list("你好世界日本語龘한국어éñß🙂🎉🦙🫠𝔘")
EXTRA_PIECES += ["👍🏽", "👨‍👩‍👧", "🇫🇷", "\n", "\t", " "]
# SmolLM2's vocabulary has no token for some bytes: UTF-8 lead bytes 0xF1-0xF4 (code points
# from U+40000 on) and a few control characters; such text cannot round-trip, so the valid
# text drawn here stays below U+40000 and leaves out control characters (Cc).
TEXT = st.lists(
    st.one_of(
        st.characters(
            max_codepoint=0x3FFFF, blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffd"
        ),
        st.sampled_from(EXTRA_PIECES),
    ),
    max_size=30,
).map("".join)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer: Tokenizer, chunks: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detok.step(chunk) for chunk in chunks] + [detok.flush()]


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, [[i] for i in ids])
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=TEXT, skip=st.booleans())
def test_uneven_chunks_and_special_tokens(tokenizer, data, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # sprinkle special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) anywhere, even inside a character
    for _ in range(data.draw(st.integers(0, 3))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([0, 1, 2])))
    chunks, rest = [], list(ids)
    while rest:
        n = data.draw(st.integers(1, 4))
        chunks.append(rest[:n])
        rest = rest[n:]
    pieces = stream(tokenizer, chunks, skip_special_tokens=skip)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("emoji", ["🦙", "👍🏽", "👨‍👩‍👧", "🏴‍☠️", "龘"])
def test_multi_token_emoji_is_emitted_whole(tokenizer, emoji):
    ids = tokenizer.encode(f"ok {emoji}!", add_special_tokens=False)
    pieces = stream(tokenizer, [[i] for i in ids])
    assert len(ids) > 4, "the character must span several tokens for this test to mean anything"
    assert "".join(pieces) == f"ok {emoji}!"
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) < len(ids), "some tokens held back until their character completed"


def test_incomplete_character_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    partial = ids[:-1]  # stops in the middle of the emoji's bytes
    assert tokenizer.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.step([i]) for i in partial)
    assert out == "a"
    assert out + detok.flush() == tokenizer.decode(partial)
    assert detok.flush() == ""


def test_unrepresentable_character_streams_like_the_full_decode(tokenizer):
    # U+40000 needs lead byte 0xF1, which has no token: only its continuation bytes survive
    ids = tokenizer.encode("a\U00040000b", add_special_tokens=False)
    pieces = stream(tokenizer, [[i] for i in ids])
    assert "".join(pieces) == tokenizer.decode(ids) == "a\ufffd\ufffd\ufffdb"


def test_stray_byte_tokens_keep_the_window_short_and_stream_like_the_full_decode(tokenizer):
    """SmolLM2 has tokens that decode to a lone U+FFFD (one byte of a character): a model
    sampling them (a logit_bias on one) must not make every step re-decode the whole output."""
    from common.detokenizer import MAX_HELD

    lone = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd"]
    assert len(lone) > 50
    ids = [lone[i % len(lone)] for i in range(400)] + tokenizer.encode(" then text 🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces, longest = [], 0
    for i in ids:
        pieces.append(detok.step([i]))
        longest = max(longest, len(detok._ids))
    pieces.append(detok.flush())
    assert longest <= 2 * MAX_HELD + 2  # emitted context + held: not the whole output
    assert "".join(pieces) == tokenizer.decode(ids)
