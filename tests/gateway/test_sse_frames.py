"""The SSE event of a step's text, made from halves rendered once per choice, is the same
bytes as the whole chunk rendered as JSON, whatever the text holds."""

from __future__ import annotations

import json

import pytest

from gateway.completions.answer import _data, _TextFrames

BASE = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1764950000, "model": "smollm2"}
TEXTS = ["hi", ' "quoted"\n', "tab\tback\\slash", "\u2028line\u2029sep\x85", "é😀", "\x00nul", ""]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("index", [0, 3])
def test_a_text_frame_is_the_chunk_rendered_whole(kind, index):
    frames = _TextFrames(kind, BASE)
    for text in TEXTS:
        if kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        frame = frames.text(index, text)
        assert frame == _data({**BASE, "choices": [choice]})
        assert json.loads(frame.decode()[len("data: "):])["choices"][0] == choice
