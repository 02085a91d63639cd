"""Streaming token ids -> text without ever emitting half a character."""

from __future__ import annotations

from collections.abc import Sequence

from common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes and a byte-level token at least one: more held ids
# than this, all still ending in U+FFFD, are bytes no later token can complete (a model
# that samples lone-byte tokens). They are emitted then, so the window, which every step
# decodes whole, stays this short: without the bound each new token re-decoded the whole
# output (quadratic work on the gateway's event loop).
MAX_HELD = 8


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Prefix / read-offset method: keep a small window of ids that starts at a character
    boundary; decode the window with and without the newest ids and emit the difference,
    but only when the window's text does not end in U+FFFD (an incomplete UTF-8 sequence
    that later tokens may complete). Invariant: "".join(step outputs) + flush() equals
    tokenizer.decode(all ids) exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _ids[:_read] is text already emitted; it is kept as decoding context because
        # decoders treat the first token of a sequence specially (e.g. strip its space).
        self._ids: list[int] = []
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add ids; return the text that is now complete (possibly "")."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
            return self._emit(len(self._ids), text, prefix_text)
        if len(self._ids) - self._read <= MAX_HELD:
            return ""
        # Held too long: emit up to the last id after which the text is whole, or, with no
        # such id (a run of stray bytes), all but the last 3 (the most of a character that
        # later ids could still complete).
        for end in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[:end])
            if len(head) > len(prefix_text) and not head.endswith(_REPLACEMENT):
                return self._emit(end, head, prefix_text)
        end = len(self._ids) - 3
        return self._emit(end, self._decode(self._ids[:end]), prefix_text)

    def _emit(self, end: int, text: str, prefix_text: str) -> str:
        """The text of ids[:end] past what was emitted; those ids become the next window's
        context (older ones are no longer needed)."""
        held = self._ids[end:]
        self._ids = self._ids[self._read : end]
        self._read = len(self._ids)
        self._ids += held
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a trailing incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]
