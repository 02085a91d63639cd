"""Token logprobs from the workers, in OpenAI's chat and completions shapes.

A non-streamed answer's logprobs are built as its steps arrive (`Logprobs.add`), straight
into the shape the body holds: the workers' messages are dropped step by step instead of
all being kept to the end and then copied, and each token id is decoded once per choice,
its text and bytes shared by every place it appears (a model's alternatives repeat)."""

from __future__ import annotations

from collections.abc import Iterable

from common.tokenizer import Tokenizer
from rpc import pdserve_pb2 as pb


class Logprobs:
    """One choice's logprobs so far, in the final shape for `kind` ("chat" or "completion")."""

    def __init__(self, kind: str, tokenizer: Tokenizer):
        self.kind, self.tokenizer = kind, tokenizer
        self._tokens: dict[int, tuple[str, list[int]]] = {}  # chat: token id -> (text, its UTF-8 bytes)
        self._texts_of: dict[int, str] = {}  # completions: token id -> its text
        self._content: list[dict] = []  # chat
        self._texts: list[str] = []  # completions: tokens, token_logprobs, top_logprobs
        self._logprobs: list[float] = []
        self._tops: list[dict[str, float]] = []

    def add(self, entries: Iterable[pb.TokenLogprobs]) -> None:
        for e in entries:
            if self.kind == "chat":
                text, raw = self._token(e.token_id)
                top = []
                for t, lp in zip(e.top_token_ids, e.top_logprobs):
                    alt, alt_raw = self._token(t)
                    top.append({"token": alt, "logprob": lp, "bytes": alt_raw})
                self._content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
            else:
                self._texts.append(self._text(e.token_id))
                self._logprobs.append(e.logprob)
                self._tops.append({self._text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)})

    def result(self) -> dict | None:
        """The `logprobs` object of the choice (None if no step carried any)."""
        if self.kind == "chat":
            return {"content": self._content} if self._content else None
        if not self._texts:
            return None
        return {"tokens": self._texts, "token_logprobs": self._logprobs, "top_logprobs": self._tops}

    def _text(self, token_id: int) -> str:
        text = self._texts_of.get(token_id)
        if text is None:
            text = self._texts_of[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        known = self._tokens.get(token_id)
        if known is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            known = self._tokens[token_id] = (text, list(self.tokenizer.token_bytes(token_id)))
        return known


def render(kind: str, tokenizer: Tokenizer, entries: list[pb.TokenLogprobs]) -> dict | None:
    """One step's logprobs (a streamed chunk's)."""
    logprobs = Logprobs(kind, tokenizer)
    logprobs.add(entries)
    return logprobs.result()
