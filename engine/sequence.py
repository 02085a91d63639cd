"""A request as the scheduler sees it: token ids and two progress counters, no tensors.

Progress is `num_computed_tokens` against `num_tokens`: a prefill chunk, a decode step
or KV that arrives from elsewhere all just move `num_computed_tokens` forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, a prefill worker writes them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first (and is preempted last)
    cache_salt: str = ""  # prefix-cache hits only among requests with the same salt (the tenant)
    arrival: int = 0  # order of arrival, set by the scheduler
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Disaggregation: the prompt's KV comes from a prefill worker into reserved blocks.
    remote_prefill: bool = False
    # Keep the blocks after finishing until Scheduler.release() (a prefill worker holds
    # them until their push to the decode worker is done).
    hold_blocks: bool = False
    # Structured output: the engine's grammar matcher (engine/grammar.py) when params.grammar
    # is set. Opaque to the scheduler; the runner asks it for the tokens allowed next.
    matcher: object | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output, the model's input

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


@dataclass(frozen=True)
class KeptKV:
    """A running request ended with its KV kept (LLMEngine.keep): its blocks stay held
    under `request_id` until release(), for another worker to copy and decode on from."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV the blocks hold: prompt and output but the last
    last_token: int  # sampled, not yet computed: what the taker decodes next
    block_ids: list[int]  # the blocks of `token_ids`, in order
