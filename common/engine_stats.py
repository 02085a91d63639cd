"""An engine's queue and KV pool at one moment: what workers report to the gateway and the
controller (rpc/convert.py carries it) for routing, admission and health."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """The queue and the KV pool now (plain reads: each field consistent on its own, so any
    thread may ask)."""

    num_waiting: int
    waiting_tokens: int
    num_running: int
    free_blocks: int
    total_blocks: int
    block_size: int
    prefix_cache_hit_rate: float
    num_preemptions: int

    @property
    def queued(self) -> int:
        return self.num_waiting + self.num_running
