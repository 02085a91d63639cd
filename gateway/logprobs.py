"""Token logprobs from the workers, in OpenAI's chat and completions shapes."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from rpc import pdserve_pb2 as pb


def render(kind: str, tokenizer: Tokenizer, entries: list[pb.TokenLogprobs]) -> dict | None:
    if not entries:
        return None

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    if kind == "chat":
        return {"content": [
            {"token": text(e.token_id), "logprob": e.logprob, "bytes": list(text(e.token_id).encode()),
             "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                              for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
            for e in entries]}
    return {"tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)} for e in entries]}
