"""One simulated worker: pdserve's own `Scheduler` and `KVCacheManager`, stepped on a
virtual clock, each step priced by the profile instead of run.

The simulator (deploy/planner/simulator.py) never re-implements scheduling: chunk caps, top-ups,
priorities, the KV budget, preemption by recompute and the reservations of remote
prefills are the engine's own code here. What it replaces is the model: a step's tokens
are a fixed id (requests run to their output length with `ignore_eos`), and its duration
is `Profile.step_s` of the step's shape, the decodes grouped as the runner groups them.
Prompts are token ids unique to each request, so no two share a prefix-cache block.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from common.sampling_params import SamplingParams
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler, SchedulerOutput, SequenceUpdate
from engine.sequence import Sequence

SIM_TOKEN = 7  # what every simulated step samples (never a stop token: requests run to max_tokens)
_PROMPT_IDS = itertools.count(1_000)  # fresh ids: no prefix-cache hit between simulated requests


@dataclass(frozen=True)
class StepShape:
    """What one schedule asks of the model, as the runner groups it: its decodes (one
    query each, at their context lengths) and its prefill chunks (start, new tokens)."""

    decode_contexts: tuple[int, ...]
    prefill_chunks: tuple[tuple[int, int], ...]
    num_sampled: int = 0  # rows through the LM head: the decodes and the chunks that end a prompt

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        decodes = tuple(c.context_len for c in out.chunks if c.num_new == 1)
        chunks = tuple((c.start, c.num_new) for c in out.chunks if c.num_new > 1)
        return cls(decodes, chunks, sum(1 for c in out.chunks if c.sample))

    @property
    def num_tokens(self) -> int:
        return len(self.decode_contexts) + sum(n for _, n in self.prefill_chunks)


def sim_prompt(num_tokens: int) -> list[int]:
    """Token ids for a simulated prompt, shared with no other prompt."""
    return [next(_PROMPT_IDS) for _ in range(num_tokens)]


class SimWorker:
    """A worker's scheduler and KV pool, with no model behind them."""

    def __init__(self, name: str, config: SchedulerConfig, kv_blocks: int, block_size: int):
        self.name = name
        self.kv = KVCacheManager(kv_blocks, block_size)
        self.scheduler = Scheduler(config, self.kv, eos_token_ids=frozenset())
        self.busy = False  # in a step (or a prefill worker's wait for its last pushes)
        self.outstanding_tokens = 0  # the gateway's count of what it routed here, not yet finished

    def add(self, request_id: str, prompt: list[int], max_tokens: int, remote_prefill: bool = False,
            hold_blocks: bool = False) -> None:
        seq = Sequence(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seq.remote_prefill = remote_prefill
        seq.hold_blocks = hold_blocks
        self.scheduler.add(seq)

    def step(self) -> tuple[SchedulerOutput, StepShape, list[SequenceUpdate]]:
        """Schedule one step and apply its outcome (what the engine's execute would); its
        shape is read before (a chunk samples if it reaches the sequence's last token)."""
        out = self.scheduler.schedule()
        shape = StepShape.of(out)
        return out, shape, self.apply(out)

    def apply(self, out: SchedulerOutput) -> list[SequenceUpdate]:
        """The outcome of a scheduled step: progress, a SIM_TOKEN for every row that samples."""
        return self.scheduler.update_from_output(out, {c.seq.request_id: SIM_TOKEN for c in out.chunks if c.sample})

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def waiting_tokens(self) -> int:
        return self.scheduler.waiting_tokens
