"""Scheduler lifecycle with fake runner outputs (no model, no tensors); every test ends
with a leak check: no request left, every block back in the pool."""

from __future__ import annotations

import random

import pytest

from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import QueueFull, RequestRejected, Scheduler
from engine.sequence import Sequence

EOS = 2


def make(num_blocks=32, block_size=4, budget=16, max_seqs=8, max_len=256, max_waiting=None, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    cfg = SchedulerConfig(budget, max_seqs, max_len, max_waiting)
    return Scheduler(cfg, kv, frozenset({EOS}))


def seq(rid, n_prompt, max_tokens=4, priority=0, base=10, **kw):
    prompt = [base + (i % 50) for i in range(n_prompt)]
    return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), priority)


def fake_tokens(out, token=7):
    """A runner that samples `token` for every chunk that samples."""
    return {c.seq.request_id: token for c in out.chunks if c.sample}


def run_to_end(s, token=7, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            return finished
        out = s.schedule()
        for u in s.update_from_output(out, fake_tokens(out, token)):
            if u.finish_reason:
                finished[u.request_id] = u.finish_reason
    raise AssertionError("scheduler did not finish")


def assert_no_leak(s):
    assert not s.has_unfinished()
    assert s.num_running == 0 and s.num_waiting == 0
    assert not s.awaiting_kv and not s.held
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    assert s.kv.num_requests == 0
    s.kv.check_invariants()


def test_decode_to_max_tokens_and_eos():
    s = make()
    s.add(seq("a", 5, max_tokens=3))
    assert run_to_end(s) == {"a": FinishReason.LENGTH}
    s.add(seq("b", 5, max_tokens=3))
    assert run_to_end(s, token=EOS) == {"b": FinishReason.STOP}
    s.add(seq("c", 5, max_tokens=3, ignore_eos=True))
    assert run_to_end(s, token=EOS) == {"c": FinishReason.LENGTH}
    s.add(seq("d", 5, max_tokens=3, stop_token_ids=(7,)))
    assert run_to_end(s) == {"d": FinishReason.STOP}
    assert_no_leak(s)


def test_chunked_prefill_runs_beside_decodes():
    s = make(num_blocks=64, budget=8)
    s.add(seq("short", 3, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, fake_tokens(out))  # short is now decoding
    s.add(seq("long", 40, max_tokens=2))
    chunk_sizes = []
    while s.requests["long"].num_computed_tokens < 40:
        out = s.schedule()
        ids = [c.seq.request_id for c in out.chunks]
        assert "short" in ids, "a long prompt must not stall a running decode"
        assert out.chunks[0].seq.request_id == "short"  # decodes first
        assert out.num_tokens <= 8
        chunk_sizes += [c.num_new for c in out.chunks if c.seq.request_id == "long"]
        s.update_from_output(out, fake_tokens(out))
    assert sum(chunk_sizes) == 40 and max(chunk_sizes) == 7  # 8 minus the decode token
    run_to_end(s)
    assert_no_leak(s)


def test_token_budget_and_max_seqs():
    s = make(num_blocks=128, budget=10, max_seqs=3)
    for i in range(6):
        s.add(seq(f"r{i}", 4, max_tokens=5))
    out = s.schedule()
    assert out.num_tokens <= 10 and len(out.chunks) <= 3
    run_to_end(s)
    assert_no_leak(s)


def test_priority_orders_admission():
    s = make(num_blocks=128, budget=4, max_seqs=1)
    s.add(seq("low", 4, priority=5))
    s.add(seq("high", 4, priority=0))
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["high"]
    run_to_end(s)
    assert_no_leak(s)


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(seq("old", 8, max_tokens=12, priority=0))
    s.add(seq("new", 8, max_tokens=12, priority=0))
    finished = run_to_end(s)
    assert finished == {"old": FinishReason.LENGTH, "new": FinishReason.LENGTH}
    assert s.num_preemptions > 0
    assert_no_leak(s)


def test_preemption_picks_lowest_priority_first():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(seq("vip", 8, max_tokens=12, priority=0))
    s.add(seq("bulk", 8, max_tokens=12, priority=9))
    preempted = []
    while s.has_unfinished():
        out = s.schedule()
        preempted += out.preempted
        s.update_from_output(out, fake_tokens(out))
    assert preempted and set(preempted) == {"bulk"}
    assert_no_leak(s)


def test_abort_at_any_point_frees_everything():
    rng = random.Random(0)
    for trial in range(30):
        s = make(num_blocks=24, budget=rng.choice([4, 8, 32]))
        ids = [f"r{i}" for i in range(6)]
        for rid in ids:
            s.add(seq(rid, rng.randint(1, 30), max_tokens=rng.randint(1, 10)))
        for _ in range(rng.randint(0, 12)):
            out = s.schedule()
            if rng.random() < 0.3:  # abort while a step is in flight
                s.abort(rng.choice(ids))
            s.update_from_output(out, fake_tokens(out))
        for rid in ids:
            s.abort(rid)
        assert s.abort("never-seen") is None
        assert_no_leak(s)


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(num_blocks=64, block_size=4, budget=64)
    s.add(seq("a", 13, max_tokens=1))
    run_to_end(s)
    s.add(seq("b", 13, max_tokens=1))
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 12 and chunk.num_new == 1  # three full blocks cached, one token left
    s.update_from_output(out, fake_tokens(out))
    assert_no_leak(s)


def test_rejections_are_immediate_and_clear():
    s = make(num_blocks=4, block_size=4, max_len=64, max_waiting=1)
    with pytest.raises(RequestRejected, match="context limit"):
        s.add(seq("too-long", 60, max_tokens=10))
    with pytest.raises(RequestRejected, match="KV blocks"):
        s.add(seq("too-big", 20, max_tokens=10))
    with pytest.raises(RequestRejected, match="empty prompt"):
        s.add(seq("empty", 0))
    s.add(seq("ok", 4))
    with pytest.raises(RequestRejected, match="duplicate"):
        s.add(seq("ok", 4))
    with pytest.raises(QueueFull):
        s.add(seq("one-too-many", 4))
    run_to_end(s)
    assert_no_leak(s)


def test_random_workload_completes_without_leaks():
    rng = random.Random(1)
    s = make(num_blocks=20, block_size=4, budget=12, max_seqs=5)
    for i in range(40):
        s.add(seq(f"r{i}", rng.randint(1, 25), max_tokens=rng.randint(1, 20), priority=rng.randint(0, 2),
                  base=rng.randint(10, 20)))
    finished = run_to_end(s)
    assert len(finished) == 40
    assert_no_leak(s)


def test_a_long_prompt_never_holds_a_short_one_back_more_than_a_step():
    s = make(num_blocks=128, block_size=4, budget=16)
    s.add(seq("long", 100, max_tokens=1))
    out = s.schedule()
    assert [c.num_new for c in out.chunks] == [16]  # alone: the cap's top-up fills the budget
    s.update_from_output(out, fake_tokens(out))
    s.add(seq("short", 6, max_tokens=1, base=70))
    out = s.schedule()
    chunks = {c.seq.request_id: c.num_new for c in out.chunks}
    assert chunks["short"] == 6, "the short prompt must run whole beside the long one's next chunk"
    assert chunks["long"] == 10 and out.num_tokens == 16
    run_to_end(s)
    assert_no_leak(s)
