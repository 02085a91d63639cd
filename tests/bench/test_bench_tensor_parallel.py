"""The tensor-parallel benchmark (bench/tensor_parallel.py) in its quickest form, for real: a
two-layer model of SmolLM2's width, TP 1 against TP 2 in one process, so the script cannot
rot. Only the shape of its table and JSON is checked, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness.worker_procs import REPO


def test_the_quick_run_compares_tp1_and_tp2_and_reads_every_ranks_collectives(tmp_path):
    out = tmp_path / "tensor_parallel.json"
    run = subprocess.run([sys.executable, "-m", "bench.tensor_parallel", "--quick", "--layers", "2", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    host = result["host"]
    assert host["cpu"] and host["cores"] >= 1 and host["kernels"]
    assert f"host: {host['cpu']}" in run.stdout and "B/A" in run.stdout

    [tp] = result["runs"]
    assert tp["dtype"] == "float32" and tp["layers"] == 2 and tp["hidden"] == 576
    assert (tp["a"]["tp"], tp["b"]["tp"]) == (1, 2) and tp["collectives_per_step"] == 2 * 2 + 2
    assert [d["batch"] for d in tp["decode"]] == [1, 8]
    for row in [*tp["decode"], tp["prefill"]]:
        assert row["ratio"] > 0
        # both ranks recorded every measured forward pass, part of it inside collectives
        assert [r["rank"] for r in row["ranks"]] == [0, 1]
        assert len({r["steps"] for r in row["ranks"]}) == 1
        assert all(0 < r["collective_share"] < 1 for r in row["ranks"])
    assert tp["prefill"]["chunk"] == 128 and tp["prefill"]["a_tok_s"] > 0 and tp["prefill"]["b_tok_s"] > 0
    assert set(tp["floor"]["all_reduce_us"]) == {"1", "8", "128"} and set(tp["floor"]["all_gather_us"]) == {"1", "8"}
