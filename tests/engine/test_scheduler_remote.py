"""Scheduler support for disaggregation: blocks reserved for remote KV, KV arrival, failure
fallbacks, aborts that wait for the writer, and blocks held after finishing (prefill side).
Fake runner outputs; every test ends with a leak check."""

from __future__ import annotations

from common.finish_reason import FinishReason
from engine.sequence import SequenceStatus
from tests.engine.test_scheduler import assert_no_leak, fake_tokens, make, run_to_end, seq


def remote(rid, n_prompt, **kw):
    s = seq(rid, n_prompt, **kw)
    s.remote_prefill = True
    return s


def test_remote_prefill_reserves_the_prompt_then_decodes_after_kv_arrives():
    s = make(num_blocks=32, block_size=4)
    s.add(remote("r", 10, max_tokens=3))
    out = s.schedule()
    assert out.chunks == []  # nothing computed locally
    (rp,) = out.remote_prefills
    assert len(rp.block_table) == 3 and rp.num_cached_tokens == 0 and rp.destination_blocks == rp.block_table
    assert s.requests["r"].status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert s.schedule().is_empty  # still waiting for the KV
    update = s.remote_kv_ready("r", 7)
    assert update.new_token_ids == [7] and update.finish_reason is None
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 10 and chunk.num_new == 1  # a decode: the prompt counts as computed
    assert run_to_end(s) == {"r": FinishReason.LENGTH}
    assert_no_leak(s)


def test_locally_cached_prefix_is_not_a_transfer_destination():
    s = make(num_blocks=32, block_size=4)
    s.add(seq("local", 13, max_tokens=1))
    run_to_end(s)
    s.add(remote("r", 13, max_tokens=2))
    (rp,) = s.schedule().remote_prefills
    assert rp.num_cached_tokens == 12 and rp.destination_blocks == rp.block_table[3:]
    s.remote_kv_ready("r", 7)
    run_to_end(s)
    assert_no_leak(s)


def test_first_token_can_finish_the_request():
    s = make()
    s.add(remote("r", 6, max_tokens=1))
    s.schedule()
    assert s.remote_kv_ready("r", 7).finish_reason is FinishReason.LENGTH
    assert s.remote_kv_ready("r", 7) is None  # unknown by now
    assert_no_leak(s)


def test_failed_remote_prefill_falls_back_to_local_prefill_or_fails():
    s = make(num_blocks=32, block_size=4)
    s.add(remote("again", 9, max_tokens=2))
    s.add(remote("give-up", 9, max_tokens=2, base=30))
    assert len(s.schedule().remote_prefills) == 2
    assert s.remote_kv_failed("again", recompute=True) is None
    update = s.remote_kv_failed("give-up", recompute=False)
    assert update.finish_reason is FinishReason.ERROR
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.seq.request_id == "again" and chunk.start == 0 and chunk.num_new == 9  # local prefill
    assert run_to_end(s) == {"again": FinishReason.LENGTH}
    assert_no_leak(s)


def test_abort_while_awaiting_kv_holds_blocks_until_released():
    s = make(num_blocks=16, block_size=4)
    s.add(remote("r", 10))
    s.schedule()
    s.abort("r")
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 16 - 3  # a write may still land in them
    s.release("r")
    assert_no_leak(s)


def test_prefill_side_holds_blocks_after_the_first_token_until_released():
    s = make(num_blocks=16, block_size=4)
    p = seq("p", 10, max_tokens=1)
    p.hold_blocks = True
    s.add(p)
    assert run_to_end(s) == {"p": FinishReason.LENGTH}
    assert "p" in s.held and s.kv.block_table("p")
    s.release("p")
    assert not s.held
    assert_no_leak(s)


def test_remote_reservation_waits_for_blocks():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add(seq("big", 12, max_tokens=4))
    s.schedule()  # holds 3 of 4 blocks
    s.add(remote("r", 8))
    out = s.schedule()
    assert out.remote_prefills == []
    while s.requests.get("big"):
        out = s.schedule()
        s.update_from_output(out, fake_tokens(out))
        if out.remote_prefills:
            break
    if not out.remote_prefills:
        out = s.schedule()
    assert [rp.seq.request_id for rp in out.remote_prefills] == ["r"]
    s.remote_kv_ready("r", 7)
    run_to_end(s)
    assert_no_leak(s)


def test_a_preempted_remote_request_is_recomputed_locally():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(remote("r", 8, max_tokens=12, priority=5))  # the less important one: the victim
    s.schedule()
    s.remote_kv_ready("r", 7)
    s.add(seq("local", 8, max_tokens=12, base=40))
    remote_again, preempted = [], []
    for _ in range(200):  # bounded: a request stuck waiting for remote KV must fail, not hang
        if not s.has_unfinished():
            break
        out = s.schedule()
        remote_again += out.remote_prefills
        preempted += out.preempted
        s.update_from_output(out, fake_tokens(out))
    assert "r" in preempted and not remote_again
    assert_no_leak(s)


def test_remote_reservations_count_against_max_num_seqs():
    """A sequence awaiting remote KV will run once its KV lands: reservations and running
    sequences together stay within max_num_seqs (the KV arriving never overfills the batch)."""
    s = make(num_blocks=64, block_size=4, max_seqs=2)
    s.add(seq("local", 6, max_tokens=4))
    for i in range(3):
        s.add(remote(f"r{i}", 6, max_tokens=4, base=10 * (i + 1)))
    out = s.schedule()
    assert len(out.chunks) == 1 and [rp.seq.request_id for rp in out.remote_prefills] == ["r0"]
    s.update_from_output(out, fake_tokens(out, 7))
    s.remote_kv_ready("r0", 7)
    finished = {}
    for _ in range(100):
        if not s.has_unfinished():
            break
        out = s.schedule()
        assert s.num_running + len(s.awaiting_kv) <= 2
        for u in s.update_from_output(out, fake_tokens(out, 7)):
            if u.finish_reason:
                finished[u.request_id] = u.finish_reason
        for rp in out.remote_prefills:  # the KV lands in the next step
            s.remote_kv_ready(rp.seq.request_id, 7)
    assert finished.keys() == {"local", "r0", "r1", "r2"}
    assert_no_leak(s)


def _decode_steps(s, n, token=7):
    for _ in range(n):
        out = s.schedule()
        s.update_from_output(out, fake_tokens(out, token))


def test_keep_ends_a_running_request_between_decode_steps_and_holds_its_kv():
    """A hand-off (decode/kv_source.py): the KV of every token but the last, its blocks held
    until release(); a request in any other state is left as it is."""
    s = make(num_blocks=32, block_size=4, budget=8)
    s.add(seq("r", 10, max_tokens=20))
    s.add(seq("long", 30, max_tokens=20, base=40))  # mid chunked prefill after the first step
    _decode_steps(s, 4)
    assert s.keep("long") is None and s.requests["long"].status is SequenceStatus.RUNNING
    r = s.requests["r"]
    assert len(r.output_token_ids) >= 2
    kept = s.keep("r")
    assert kept.token_ids == r.token_ids[:-1] and kept.last_token == r.token_ids[-1]
    assert len(kept.block_ids) == -(-len(kept.token_ids) // 4) and kept.block_ids == s.kv.block_table("r")[:len(kept.block_ids)]
    assert "r" not in s.requests and "r" in s.held
    assert s.keep("r") is None and s.keep("unknown") is None
    s.release("r")
    s.abort("long")
    assert_no_leak(s)


def test_a_replay_with_remote_kv_reserves_all_its_tokens_and_decodes_its_last_next():
    """A replay's writer fills the KV of every token but the last (prompt and output); its
    KV's arrival adds no token: the last one is decoded next, here."""
    s = make(num_blocks=32, block_size=4)
    r = remote("r", 9, max_tokens=6)
    for t in (21, 22, 23):  # three output tokens produced elsewhere
        r.append_token(t)
    s.add(r)
    (rp,) = s.schedule().remote_prefills
    assert rp.kv_token_ids == r.token_ids[:-1] and len(rp.kv_token_ids) == 11
    assert len(rp.block_table) == 3 and rp.destination_blocks == rp.block_table[:3]
    update = s.remote_kv_ready("r", 99)
    assert update.new_token_ids == [] and update.finish_reason is None
    assert r.output_token_ids == [21, 22, 23] and r.num_computed_tokens == 11
    (chunk,) = s.schedule().chunks
    assert chunk.start == 11 and chunk.num_new == 1 and chunk.token_ids == [23]
    assert run_to_end(s) == {"r": FinishReason.LENGTH}
    assert r.output_token_ids[:3] == [21, 22, 23] and len(r.output_token_ids) == 6
    assert_no_leak(s)


def test_a_replay_whose_kv_is_one_block_past_a_boundary_sends_no_block_for_its_last_token():
    s = make(num_blocks=32, block_size=4)
    r = remote("r", 7, max_tokens=4)
    for t in (21, 22):  # 9 tokens: KV of 8 (two blocks); the last starts a third
        r.append_token(t)
    s.add(r)
    (rp,) = s.schedule().remote_prefills
    assert len(rp.block_table) == 3 and rp.destination_blocks == rp.block_table[:2]
    s.remote_kv_ready("r", 99)
    run_to_end(s)
    assert_no_leak(s)
