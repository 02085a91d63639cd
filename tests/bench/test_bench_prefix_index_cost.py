"""The prefix index's cost benchmark (bench/prefix_index_cost.py), run small so it cannot rot:
it fills an index, applies events and routes with the index on and off; the figures are
only checked to be there and the index's entries to be what it was fed (no timing asserted)."""

from __future__ import annotations

from bench.prefix_index_cost import run


def test_a_small_run_measures_every_figure():
    r = run(workers=2, blocks=256, prompt_blocks=16)
    assert r["entries"] == 4 * 256  # 2 decode + 2 prefill workers, 256 distinct blocks each
    for key in ("bytes_per_entry", "resync_ns_per_entry", "event_ns", "hash_prompt_us", "route_us_index",
                "route_us_no_index", "route_ratio"):
        assert r[key] > 0, key
    assert r["host"]
