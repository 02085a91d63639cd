"""Token ids -> text deltas for one response: UTF-8-safe detokenization and stop strings.

Text that could be the start of a stop string is held back until it is known not to be
one, so a stop string is never sent, even split across tokens. Held-back text was already
searched, so each step searches only where a stop string could newly end: the new text
and the last len(stop) - 1 characters before it. The work per token is then the new text
times the number of stop strings, whatever their length (gateway/completions/protocol.py bounds it).
"""

from __future__ import annotations

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.stopped = False  # a stop string was found: the caller ends the stream
        self.stop_string: str | None = None  # which one (the first in the text, if several)

    def push(self, token_ids: list[int]) -> str:
        """Text to send now for these new tokens."""
        if self.stopped:
            return ""
        if not self._stop:  # nothing to search for or hold back (most requests)
            return self._detok.step(token_ids)
        return self._emit(self._pending, self._detok.step(token_ids), final=False)

    def finish(self) -> str:
        """Whatever was held back, at the end of the generation."""
        if self.stopped:
            return ""
        return self._emit(self._pending, self._detok.flush(), final=True)

    def _emit(self, searched: str, new: str, final: bool) -> str:
        """`searched`: held back and already known to hold no whole stop string."""
        text = searched + new
        seen = len(searched)
        found = [(i, s) for s in self._stop if (i := text.find(s, max(0, seen - len(s) + 1))) >= 0]
        if found:
            cut, self.stop_string = min(found, key=lambda f: f[0])
            self.stopped = True
            self._pending = ""
            return text[:cut]
        if final or not self._stop:
            self._pending = ""
            return text
        keep = min(self._hold, len(text))
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]
