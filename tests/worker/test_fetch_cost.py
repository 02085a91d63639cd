"""The prefix fetch's cost model (worker/fetch_cost.py): fixed part and per-block part fitted
from measured fetches; a fetch is skipped only when predicted slower than computing, and one
skipped fetch in `probe_every` is made anyway so the model keeps measuring."""

from __future__ import annotations

import pytest

from worker.fetch_cost import FetchCost


def test_unmeasured_fetches_are_tried():
    cost = FetchCost()
    assert cost.predict_s(5) is None
    assert cost.worth_it(5, compute_s=0.001) and cost.worth_it(5, compute_s=None)


def test_a_fixed_wait_and_a_rate_are_told_apart():
    cost = FetchCost()
    for blocks in (2, 5, 10, 30):
        cost.observe(blocks, 0.3 + 0.002 * blocks)  # a busy holder: 0.3 s before the push, then 2 ms a block
    assert cost.predict_s(100) == pytest.approx(0.5)
    assert not cost.worth_it(4, compute_s=0.16)  # 4 blocks: the fixed wait dominates, computing is cheaper
    assert cost.worth_it(30, compute_s=1.2)  # 30 blocks: fetching saves most of a second


def test_one_size_seen_scales_as_a_rate_and_skipped_fetches_are_probed():
    cost = FetchCost(probe_every=3)
    cost.observe(5, 0.4)
    assert cost.predict_s(10) == pytest.approx(0.8)
    decisions = [cost.worth_it(10, compute_s=0.1) for _ in range(6)]
    assert decisions == [False, False, True, False, False, True]  # every third skipped one is made
