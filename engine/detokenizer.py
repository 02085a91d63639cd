"""Streaming token ids -> text without ever emitting half a character."""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


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
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        # The emitted ids become the next window's context; older ones are no longer needed.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a trailing incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]
