"""One sampled token's logprobs, as the engine returns them and the workers send them on."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """Logprobs of one sampled token, from log_softmax of the raw model logits."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the params.logprobs most likely (token id, logprob)
