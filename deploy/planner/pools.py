"""The pools' sizes: how many prefill and decode workers a deployment runs, and the splits
of a number of workers between them (what `pdserve tune` and the online planner compare)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pools:
    prefill: int  # 0: aggregated, every worker prefills and decodes
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"aggregated x{self.decode}" if self.prefill == 0 else f"{self.prefill}P + {self.decode}D"


def splits(workers: int, aggregated: bool = True) -> list[Pools]:
    """Every disaggregated split of `workers` (at least one worker in each pool), after the
    aggregated one when `aggregated`."""
    return [Pools(0, workers)] * aggregated + [Pools(p, workers - p) for p in range(1, workers)]
