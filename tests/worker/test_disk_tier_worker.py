"""A decode worker with the prefix cache's disk tier (`--kv-disk-dir`), as a real process:
a prompt evicted from its small pool is written to disk, the worker is killed (kill -9) and
started again on the same folder, and the prompt comes back with its prefix read from disk
(the Metrics RPC's pdserve_engine_prefix_tier_tokens_total{tier="disk"}) and the same
greedy tokens as the first time."""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO, start_workers, wait_until
from common.block_hash import block_hashes
from deploy.config import ConfigError, DeployConfig, PoolConfig
from rpc import pdserve_pb2 as pb
from worker import kv_disk_folders
from tests.worker.grpc_calls import assert_idle, generate, random_prompt
from worker.process import engine_configs, worker_arguments

BLOCK = 16


def _series(worker, name: str) -> float | None:
    text = worker.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition.decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_a_restarted_worker_serves_an_evicted_prefix_from_disk(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa", seed=7)
    disk = tmp_path / "kv-disk"
    args = ["--no-transfer", "--dtype", "float32", "--kv-blocks", "12", "--max-num-batched-tokens", "32",
            "--worker-id", "5", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.01"]
    rng = random.Random(11)
    prompt = random_prompt(rng, 80)  # 4 full blocks before its last token
    others = [random_prompt(rng, 150) for _ in range(3)]  # 10 blocks each: the pool holds 12

    (d,) = start_workers([("decode", args, {})], model, tmp_path, timeout_s=120)
    try:
        first = generate(d, prompt, 8, ignore_eos=True)
        assert first.usage.cached_prompt_tokens == 0
        for p in others:
            generate(d, p, 8, ignore_eos=True)
        # the worker's own folder (by role and id), then the model's compatibility key; each
        # file named by its block's hash keyed with the tier's secret (engine/disk_tier.py)
        secret = (disk / "decode-5" / "secret").read_bytes()
        files = [f"{hashlib.blake2b(x, key=secret, digest_size=16).hexdigest()}.kvb"
                 for x in block_hashes(prompt, BLOCK)[:4]]
        wait_until(lambda: all(any((disk / "decode-5").glob(f"*/{f}")) for f in files), 30,
                   "the prompt's blocks written to the disk tier")
        assert _series(d, "pdserve_engine_kv_disk_entries") >= 4
        assert_idle(d)
    finally:
        d.kill()  # kill -9: nothing flushed on the way out
        d.stop()

    (d,) = start_workers([("decode", args, {})], model, tmp_path, timeout_s=120)
    try:
        assert "found" in d.log_tail(200) and _series(d, "pdserve_engine_kv_disk_entries") >= 4
        again = generate(d, prompt, 8, ignore_eos=True)
        assert again.tokens == first.tokens
        assert again.usage.cached_prompt_tokens == 4 * BLOCK
        assert _series(d, 'pdserve_engine_prefix_tier_tokens_total{tier="disk"}') == 4 * BLOCK
        assert _series(d, "pdserve_engine_kv_disk_corrupt_blocks_total") == 0
        assert_idle(d)
    finally:
        d.stop()


def test_a_pools_disk_tier_reaches_each_worker_in_a_folder_of_its_own():
    pool = PoolConfig(kv_disk_dir="/var/kv", kv_disk_gib=2.0)
    for role, worker_id in (("decode", "3"), ("prefill", "0")):
        args = worker_arguments(role).parse_args(["--port", "0", "--worker-id", worker_id, *pool.worker_args()])
        cache, _ = engine_configs(args, 512)
        assert cache.disk_dir == f"/var/kv/{role}-{worker_id}" and cache.disk_bytes == 2 << 30
    args = worker_arguments("decode").parse_args(["--port", "0", *PoolConfig().worker_args()])
    assert engine_configs(args, 512)[0].disk_dir is None
    with pytest.raises(ConfigError, match="kv_disk_dir: the disk tier is not supported with tensor parallelism"):
        DeployConfig.from_dict({"decode": {"kv_disk_dir": "/var/kv", "tp_size": 2}})


def test_prompt_tokens_brought_back_from_a_prefill_workers_disk_tier_are_reported_cached(tmp_path):
    """1P+1D, pools too small to keep a prompt, the disk tier on the prefill worker: evicted
    by others, the prompt comes back from the prefill worker's disk (computed nowhere), and
    the answer's cached_prompt_tokens counts those tokens, whatever worker and tier held them."""
    model = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa", seed=7)
    common = ["--dtype", "float32", "--kv-blocks", "12", "--max-num-batched-tokens", "32"]
    rng = random.Random(12)
    prompt = random_prompt(rng, 80)  # 4 full blocks before its last token
    others = [random_prompt(rng, 150) for _ in range(3)]  # 10 blocks each: each pool holds 12
    p, d = start_workers([("prefill", [*common, "--kv-disk-dir", str(tmp_path / "p"), "--kv-disk-gib", "0.01"], {}),
                          ("decode", common, {})], model, tmp_path, timeout_s=120)
    try:
        first = generate(d, prompt, 4, prefill=[p.address], ignore_eos=True)
        assert first.usage.cached_prompt_tokens == 0
        for other in others:
            generate(d, other, 4, prefill=[p.address], ignore_eos=True)
        wait_until(lambda: (_series(p, "pdserve_engine_kv_disk_entries") or 0) >= 4, 30,
                   "the prompt's blocks on the prefill worker's disk")
        again = generate(d, prompt, 4, prefill=[p.address], ignore_eos=True)
        assert again.tokens == first.tokens
        assert _series(p, 'pdserve_engine_prefix_tier_tokens_total{tier="disk"}') == 4 * BLOCK  # from its disk
        assert again.usage.cached_prompt_tokens == 4 * BLOCK, again.usage
        assert_idle(p, d)
    finally:
        p.stop()
        d.stop()


def test_gone_workers_folders_are_reclaimed_and_running_ones_kept(tmp_path):
    """A planner moving workers leaves a folder per worker id: a worker's start removes
    those no process holds, the least recently used first, down to one worker's bound, and
    any unused for an hour; a running worker's folder (its lock held) is never touched."""
    root = tmp_path / "kv"
    now = time.time()

    def folder(name: str, size: int, age_s: float) -> Path:
        f = root / name / "key"
        f.mkdir(parents=True, mode=0o700)
        (f / "block.kvb").write_bytes(b"x" * size)
        for p in (f / "block.kvb", f, f.parent):
            os.utime(p, (now - age_s, now - age_s))
        return f.parent

    old, older, recent = folder("decode-1", 100, 60), folder("prefill-2", 100, 120), folder("decode-3", 100, 10)
    stale = folder("decode-4", 10, 2 * kv_disk_folders.RECLAIM_UNUSED_S)
    running = folder("decode-5", 1000, 300)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from worker import kv_disk_folders as k; "
                               f"k.claim(__import__('pathlib').Path({str(running)!r})); print('held', flush=True); "
                               "sys.stdin.read()"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        kv_disk_folders.claim(root / "decode-9")  # this worker's own
        removed = kv_disk_folders.reclaim(root, keep_bytes=250, now=now)
        assert sorted(g.path.name for g in removed) == ["decode-4", "prefill-2"]  # stale, then the LRU past 250
        assert old.exists() and recent.exists() and running.exists() and (root / "decode-9").exists()
        with pytest.raises(kv_disk_folders.InUse, match="in use by another running worker"):
            kv_disk_folders.claim(running)
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert [g.path.name for g in kv_disk_folders.reclaim(root, keep_bytes=0, now=now)] == \
        ["decode-1", "decode-3", "decode-5"]  # its holder ended: gone too (claimed last, so used last)
