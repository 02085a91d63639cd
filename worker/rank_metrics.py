"""A tensor-parallel worker's per-rank series (prefix pdserve_engine_tp_), read from its
group's shared clock table at each scrape (engine/parallel/rank_clock.py): every rank's
forward passes, their seconds and the seconds spent inside the group's collectives.
`rate(pdserve_engine_tp_collective_seconds_total) / rate(pdserve_engine_tp_step_seconds_total)`
by rank is each rank's share of waiting; the rank that waits least while computing most
is the straggler."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

from engine.parallel.rank_clock import RankClocks


class RankCollector:
    """The prometheus collector over one group's clocks."""

    def __init__(self, clocks: RankClocks):
        self.clocks = clocks

    def collect(self):
        steps = CounterMetricFamily("pdserve_engine_tp_steps", "Forward passes run, by tensor-parallel rank",
                                    labels=["rank"])
        seconds = CounterMetricFamily("pdserve_engine_tp_step_seconds", "Seconds in forward passes (the model and LM "
                                      "head), by tensor-parallel rank", labels=["rank"])
        waits = CounterMetricFamily("pdserve_engine_tp_collective_seconds", "Seconds of those inside the group's "
                                    "collectives (all-reduce, all-gather), by tensor-parallel rank", labels=["rank"])
        for t in self.clocks.read():
            rank = str(t.rank)
            steps.add_metric([rank], t.steps)
            seconds.add_metric([rank], t.step_s)
            waits.add_metric([rank], t.collective_s)
        return [steps, seconds, waits]


def register(clocks: RankClocks) -> None:
    """Add the group's series to this process's registry (once: a process holds one group)."""
    REGISTRY.register(RankCollector(clocks))
