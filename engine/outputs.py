"""What a finished (or streaming) request gives back to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.token_logprobs import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated so far
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
