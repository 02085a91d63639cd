"""Per-request sampling parameters (the user-facing knobs of one generation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.grammar_spec import Grammar


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 / -1 and top_p 1.0 and min_p 0.0 disable the
    respective filters. repetition_penalty is the multiplicative (CTRL / Hugging Face) kind
    over prompt and output tokens; presence / frequency penalties are OpenAI's additive
    kind over output tokens only. logit_bias maps token id -> value added to its logit.
    A request with a seed gets the same tokens whatever else shares its batch. A grammar
    restricts every token to those its JSON schema allows next (and ends the output where
    the schema does, so it excludes ignore_eos).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled one)
    grammar: Grammar | None = None  # a JSON schema the output follows (engine/grammar.py)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r}: {why}")

        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise SamplingParamsError(f"logit_bias key {tok!r}: must be a token id (int >= 0)")
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(f"logit_bias[{tok}]={bias!r}: must be in [-100, 100]")
        if self.grammar is not None and self.ignore_eos:
            raise bad("ignore_eos", "cannot be combined with a grammar: the output ends where the grammar does")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def uses_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
