"""The GPU prefill/decode run (bench/gpu_pd.py), dry-run on this CPU with tiny sizes, so the
script a lent GPU machine runs cannot rot between device sessions: every phase runs for real
(NIXL pushes between two processes, a prefill and a decode worker and the gateway serving a
tiny checkpoint, decode steps and throughput against transformers); no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.gpu_pd import PHASES, parse_args
from bench.harness.pd_report import verdict
from bench.harness.worker_procs import REPO


def test_the_cpu_dry_run_runs_every_phase_and_the_tokens_and_kv_check_out(smollm2_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_pd", "--cpu", "--quick", "--out", str(out)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    report = json.loads((out / "gpu_pd.json").read_text())
    assert report["device_kind"] == "cpu" and report["device"] and report["exit"]["code"] == 0
    assert list(report["phases"]) == list(PHASES)
    assert all(p["status"] == "ok" for p in report["phases"].values())
    assert f"[{report['device']}] KV push over NIXL" in proc.stdout  # every figure names the device

    (push,) = report["phases"]["push"]["rows"]
    assert push["memory"] == "DRAM" and push["verified"] and push["push_bytes"] == push["blocks"] * 16 * 2 * 2 * 2 * 64 * 2
    assert push["push_gbps"] > 0 and push["copy_gbps"] > 0 and len(push["push_ms"]) == 3
    assert any("remote memory write" in w and "host" in w for w in push["ucx_writes"]), push["ucx_writes"]

    (served,) = report["phases"]["serve"]["models"]
    assert served["tokens_match"] and served["kv_remote"]
    g, c = served["generate"], served["completions"]
    assert len(g["tokens"]) == served["max_new"] and g["tokens"] == g["cpu_engine"] == g["transformers"]
    assert g["served"]["kv_blocks"] > 0 and g["served"]["prefill_worker"]
    assert c["headers"]["x-pdserve-prefill"] == "remote" and int(c["headers"]["x-pdserve-kv-blocks"]) > 0
    assert c["text"] == c["reference_text"] and c["cpu_engine"] == c["transformers"]
    assert served["transfer_metrics"]["bytes"] > 0 and served["transfer_metrics"]["pushes"] >= 2

    decode = report["phases"]["decode"]
    assert [r["batch"] for r in decode["rows"]] == [1, 8]
    for row in decode["rows"]:
        assert row["eager_ms"] > 0 and row["roofline_ms"] > 0 and row["steps"] > 0
        assert row["graphs"].startswith("not available")  # no graph figure until the engine captures graphs
    assert decode["rates"]["bandwidth"] > 0

    tp = report["phases"]["throughput"]
    assert tp["pdserve_s"] > 0 and tp["transformers_s"] > 0 and tp["output_tokens"] > 0


def _report(tokens_match: bool, kv_remote: bool, push_status: str = "ok") -> dict:
    return {"phases": {"push": {"status": push_status},
                       "serve": {"status": "ok", "models": [{"model": "tiny", "tokens_match": tokens_match,
                                                             "kv_remote": kv_remote}]}}}


def test_wrong_tokens_or_local_kv_exit_1_and_an_unfinished_phase_exit_3():
    assert verdict(_report(True, True))[0] == 0
    assert verdict(_report(False, True)) == (1, "token mismatch on tiny")
    assert verdict(_report(True, False))[0] == 1
    assert verdict(_report(False, True, "timed out after 60 s"))[0] == 1  # a mismatch outranks the rest
    code, why = verdict(_report(True, True, "failed (exit 1)"))
    assert code == 3 and "push: failed (exit 1)" in why


def test_running_without_smollm2_needs_its_tokenizer(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--smollm2", "none"])
    args = parse_args(["--out", str(tmp_path), "--smollm2", "none", "--tokenizer", str(tmp_path)])
    assert not args.serve_smollm2 and args.device == "cuda" and args.dtype == "bfloat16"
