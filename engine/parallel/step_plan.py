"""What rank 0 sends the other tensor-parallel ranks each step: the schedule as plain data.

Only what a rank's forward pass needs crosses the boundary (vLLM V1's shape): each chunk's
new tokens, where they start, its block table and whether its last row is sampled. No
Sequence, no sampling parameters: sampling happens once, on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PlannedChunk:
    """A ScheduledChunk without its Sequence: what ModelRunner's step preparation reads."""

    token_ids: list[int]
    start: int
    num_new: int
    block_table: list[int]
    sample: bool

    @property
    def context_len(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True)
class StepPlan:
    chunks: list[PlannedChunk]

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepPlan:
        return cls([PlannedChunk(c.token_ids, c.start, c.num_new, list(c.block_table), c.sample) for c in out.chunks])
