"""The prefill and decode workers as real processes: gRPC, NIXL, a tiny random model.

One module-wide set of workers (bench/harness/worker_procs.py), started together so their
start-ups overlap: the prefill worker P and the decode worker D that most tests use, a
second prefill worker that the crash test kills, and a small aggregated decode worker (one
sequence, one waiting slot) for the full-queue test. P, D and the victim run with
PDSERVE_FAULT_STALL_FILE, each with its own path, so a test can freeze an engine loop on
purpose (while its gRPC server keeps answering) by creating that file: that is how the
tests cancel "while P holds the request" or outlast the Abort timeout without timing luck.

Outputs are compared token for token in float64 against the offline engine in this
process and transformers' greedy generation; every test that sends work ends with a
leak check on the workers it used (Stats: nothing queued or running, every block free).
The calls the tests make on a worker (Generate, the leak check, a frozen loop, a line in
its log) are in grpc_calls.py. Every test here but the last shares the one set of
workers, so they stay in this one file: a second file would start a second set.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
import torch

from bench.harness.tiny_models import load_hf, write_tiny_checkpoint
from bench.harness.worker_procs import REPO, WorkerProc, start_workers, wait_until
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from rpc import auth
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from tests.worker.grpc_calls import (RPC_TIMEOUT_S, assert_idle, generate, generate_held_by, generate_request,
                                     random_prompt, rpc_error, stalled, wait_logged)

BLOCK = 16
BUDGET = 32  # --max-num-batched-tokens: prompts longer than this are prefilled in chunks
CONTEXT = 512  # the tiny checkpoint's max_position_embeddings
KV_BLOCKS = 160
STALL_FLOOR_S = 1.5  # D's --stall-timeout: a stalled loop is judged wedged this soon
EOS = 2
VICTIM_STEP_FLOOR_S = 0.1  # each step of the prefill workers frozen mid-prefill
ABORT_BOUND_S = 3.0  # D's --abort-bound: an abort unconfirmed this long sets its blocks aside


class Workers(NamedTuple):
    p: WorkerProc  # prefill
    d: WorkerProc  # decode, with transfer
    victim: WorkerProc  # prefill, killed by test 3
    small: WorkerProc  # decode --no-transfer --max-num-seqs 1 --max-waiting 1
    term: WorkerProc  # prefill, shut down (SIGTERM) by test 3
    stall: dict[str, Path]  # role key ("p", "d", "victim", "term") -> its stall file


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama-gqa", seed=7)


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    stall = {k: tmp / f"{k}.stall" for k in ("p", "d", "victim", "term")}

    def args(worker_id: int, blocks: int, budget: int, *more: str) -> list[str]:
        return ["--worker-id", str(worker_id), "--dtype", "float64", "--kv-blocks", str(blocks),
                "--max-num-batched-tokens", str(budget), *more]

    procs = start_workers([
        # P's prefill of a long prompt takes many small steps: a wide window to act in.
        ("prefill", args(0, KV_BLOCKS, BUDGET // 2), {"PDSERVE_FAULT_STALL_FILE": str(stall["p"])}),
        ("decode", args(0, KV_BLOCKS, BUDGET, "--stall-timeout", str(STALL_FLOOR_S), "--abort-bound",
                        str(ABORT_BOUND_S)),
         {"PDSERVE_FAULT_STALL_FILE": str(stall["d"])}),
        # The victim and term are frozen mid-prefill: their steps are held to VICTIM_STEP_FLOOR_S,
        # so a 450-token prompt (29 steps) is seconds of prefill on any host, not a window a fast
        # one closes before the test sees the request taken.
        ("prefill", args(1, 64, BUDGET // 2), {"PDSERVE_FAULT_STALL_FILE": str(stall["victim"]),
                                               "PDSERVE_FAULT_STEP_FLOOR_S": str(VICTIM_STEP_FLOOR_S)}),
        ("decode", args(1, 64, BUDGET, "--no-transfer", "--max-num-seqs", "1", "--max-waiting", "1"), {}),
        ("prefill", args(2, 64, BUDGET // 2), {"PDSERVE_FAULT_STALL_FILE": str(stall["term"]),
                                               "PDSERVE_FAULT_STEP_FLOOR_S": str(VICTIM_STEP_FLOOR_S)}),
    ], model, tmp)
    try:
        yield Workers(*procs, stall)
    finally:
        for f in stall.values():
            f.unlink(missing_ok=True)
        for w in procs:
            w.stop()


@pytest.fixture(scope="module")
def offline(model) -> LLMEngine:
    """The in-process engine, configured like the workers."""
    return LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, KV_BLOCKS), SchedulerConfig(BUDGET, 64, CONTEXT))


@pytest.fixture(scope="module")
def reference(model, offline):
    """Greedy continuations from transformers, checked against the offline engine once each."""
    hf = load_hf(model)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if missing:  # the offline engine runs them as one batch, like a busy worker
            outs = {f"r{i}": [] for i in range(len(missing))}
            for i, p in enumerate(missing):
                offline.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens))
            while offline.has_unfinished():
                for delta in offline.step():
                    outs[delta.request_id].extend(delta.token_ids)
            assert offline.kv_manager.num_free_blocks == offline.kv_manager.num_total_blocks
            for i, p in enumerate(missing):
                hf_out = _hf_greedy(hf, p, max_tokens)
                assert outs[f"r{i}"] == hf_out, f"offline engine vs transformers, prompt of {len(p)} tokens"
                cache[(tuple(p), max_tokens)] = hf_out
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    return greedy


# ---------------------------------------------------------------------------- helpers

def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=EOS, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    return gen[: gen.index(EOS) + 1] if EOS in gen else gen




# ---------------------------------------------------------------------------- 1. outputs

def _mixed_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = random_prompt(rng, 70)  # four full blocks and a bit, shared by the last two
    return [random_prompt(rng, 5), random_prompt(rng, 17), random_prompt(rng, 3 * BUDGET + 7), random_prompt(rng, 200),
            shared + random_prompt(rng, 9), shared + random_prompt(rng, 30)]


def test_disaggregated_greedy_equals_aggregated_offline_and_transformers(workers, reference):
    d, p = workers.d, workers.p
    # One at a time: remote prefill first (a cold decode-side cache), then aggregated.
    prompts = _mixed_prompts(seed=1)
    want = reference(prompts, 8)
    for prompt, ref in zip(prompts, want):
        assert generate(d, prompt, prefill=[p.address]).tokens == ref, f"disaggregated, {len(prompt)} tokens"
        assert generate(d, prompt).tokens == ref, f"aggregated, {len(prompt)} tokens"
    before = d.stats().kv_blocks_transferred

    # Concurrently, fresh prompts, each both ways at once from several client threads.
    prompts = _mixed_prompts(seed=2)
    want = reference(prompts, 12)
    jobs = [(prompt, ref, prefill) for prompt, ref in zip(prompts, want) for prefill in ([p.address], [])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: generate(d, job[0], 12, job[2]), jobs))
    for (prompt, ref, prefill), got in zip(jobs, results):
        assert got.tokens == ref, f"{'disaggregated' if prefill else 'aggregated'}, {len(prompt)} tokens, concurrent"
        assert got.finish == (pb.STOP if ref[-1] == EOS else pb.LENGTH)
    assert d.stats().kv_blocks_transferred > before  # some of them really went through P
    assert_idle(d, p)


def test_seeded_sampling_and_logprobs_are_the_same_through_a_prefill_worker(workers, offline):
    """The first token is sampled on P, the rest on D: with a seed (counter-based draws) and
    penalties over prompt + output, both halves must line up with one engine doing it all."""
    d, p = workers.d, workers.p
    prompt = random_prompt(random.Random(10), 75)
    knobs = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.3, seed=1234, logprobs=2)
    offline.add_request("seeded", prompt, SamplingParams(max_tokens=12, ignore_eos=True, **knobs))
    want, want_lps = [], []
    while offline.has_unfinished():
        for delta in offline.step():
            want += delta.token_ids
            want_lps += delta.logprobs
    for name, prefill in (("disaggregated", [p.address]), ("aggregated", [])):
        req = generate_request(prompt, 12, prefill, ignore_eos=True, **knobs)
        msgs = list(d.stub.Generate(req, timeout=RPC_TIMEOUT_S))
        tokens = [t for m in msgs for t in m.token_ids]
        lps = [lp for m in msgs for lp in m.logprobs]
        assert tokens == want, name
        assert [lp.token_id for lp in lps] == tokens, name
        for lp, ref in zip(lps, want_lps):
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5), name
            assert list(lp.top_token_ids) == [t for t, _ in ref.top], name
    assert_idle(d, p)


# ---------------------------------------------------------------------------- 2. leaks

def test_cancellations_anywhere_leak_no_blocks_and_no_requests(workers, reference):
    d, p = workers.d, workers.p
    rng = random.Random(3)
    errors: list[BaseException] = []

    def stream_then_cancel(req: pb.GenerateRequest, cancel_after_msgs: int | None, delay_s: float = 0.0):
        call = d.stub.Generate(req, timeout=RPC_TIMEOUT_S)
        try:
            if cancel_after_msgs is None:  # cancel at a random moment
                time.sleep(delay_s)
                call.cancel()
            n = 0
            for msg in call:
                n += 1
                if msg.finish_reason != pb.FINISH_NONE:
                    return
                if cancel_after_msgs is not None and n >= cancel_after_msgs:
                    call.cancel()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                errors.append(e)
        except BaseException as e:
            errors.append(e)

    # (a) Cancelled while being admitted: D's loop is stalled, so the call waits in the handler.
    with stalled(workers.stall["d"]):
        call = d.stub.Generate(generate_request(random_prompt(rng, 40), 400, [p.address], rid="admit-cancel",
                                                ignore_eos=True), timeout=RPC_TIMEOUT_S)
        time.sleep(0.3)  # long enough for the call to reach the handler (if not, less is tested, no failure)
        call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    wait_logged(d, "request admit-cancel: cancelled")  # aborted, not left to run 400 tokens

    # (b) Cancelled after D sent the Prefill, with P's loop frozen before it admits it: D's
    # Abort waits in P behind the admission, and the blocks come back once P confirms.
    with stalled(workers.stall["p"]):
        call = d.stub.Generate(generate_request(random_prompt(rng, 200), 16, [p.address], rid="prefill-pending-cancel"),
                               timeout=RPC_TIMEOUT_S)
        wait_logged(d, "request prefill-pending-cancel: prefill on")
        call.cancel()
        time.sleep(0.3)
        assert d.stats().free_blocks < KV_BLOCKS  # unconfirmed: still reserved
    with pytest.raises(grpc.RpcError):
        list(call)

    # (c) Cancelled while P prefills and pushes: three long prompts keep P busy for a while;
    # once it has one, its loop is frozen and all three are cancelled.
    calls = [d.stub.Generate(generate_request(random_prompt(rng, 480), 16, [p.address], rid=f"transfer-cancel-{i}"),
                             timeout=RPC_TIMEOUT_S) for i in range(3)]
    wait_until(lambda: (s := p.stats()).running_requests + s.waiting_requests > 0, 20, "P to take a prompt")
    with stalled(workers.stall["p"]):
        for c in calls:
            c.cancel()
        time.sleep(0.3)  # D sends Abort, which P can only confirm once its loop runs again
    for c in calls:
        with pytest.raises(grpc.RpcError):
            list(c)

    # (d) A mixed crowd: some finish, some are cancelled mid-decode, some at random moments
    # (before admission, before or during the remote prefill, during local prefill).
    threads = []
    for i in range(14):
        prefill = [p.address] if i % 2 == 0 else []
        req = generate_request(random_prompt(rng, rng.choice([6, 40, 150, 300])), rng.choice([4, 60]), prefill,
                               rid=f"mix-{i}", ignore_eos=True)
        kind = i % 3
        args = (req, None, rng.uniform(0.0, 0.2)) if kind == 0 else (req, 3) if kind == 1 else (req, 10**6)
        threads.append(threading.Thread(target=stream_then_cancel, args=args))
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a Generate stream hung"
    assert not errors, errors
    assert_idle(d, p)

    # Whatever was cancelled where, the blocks that came back hold nothing stale.
    prompt = random_prompt(rng, 100)
    [want] = reference([prompt], 8)
    assert generate(d, prompt, prefill=[p.address]).tokens == want
    assert generate(d, prompt).tokens == want
    assert_idle(d, p)


def test_blocks_stay_reserved_until_the_prefill_worker_confirms_the_abort(workers):
    """P's loop frozen past the Abort's 10 s timeout: D must keep asking, not reuse the blocks."""
    d, p = workers.d, workers.p
    with stalled(workers.stall["p"]):
        call = d.stub.Generate(generate_request(random_prompt(random.Random(8), 150), 8, [p.address],
                                                rid="unconfirmed"), timeout=RPC_TIMEOUT_S)
        wait_logged(d, "request unconfirmed: prefill on")
        call.cancel()
        wait_logged(d, f"request unconfirmed: {p.address} did not confirm the abort", timeout_s=20)
        time.sleep(0.2)
        s = d.stats()
        assert s.free_blocks < s.total_blocks, "blocks P may still write were freed without its confirmation"
    assert_idle(d, p)  # confirmed once P's loop runs again


# ---------------------------------------------------------------------------- 3. dead prefill worker

def test_a_prefill_worker_gone_silent_costs_the_abort_bound_not_the_request(workers, reference):
    """The victim freezes mid-prefill (SIGSTOP: its connections stay open, nothing answers).
    gRPC keepalive fails D's Prefill call; the Abort gets no answer either, and that proves
    nothing (the victim may resume and write). Past D's abort bound the request goes on
    without its blocks (prefilled locally, the right tokens) while those blocks stay set
    aside; they are free again once the victim, resumed, confirms the abort."""
    d, victim = workers.d, workers.victim
    prompt = random_prompt(random.Random(12), 450)
    [want] = reference([prompt], 8)
    result = generate_held_by(d, victim, prompt, [victim.address], "silent-req")
    try:
        with stalled(workers.stall["victim"]):  # mid-prefill, surely
            victim.proc.send_signal(signal.SIGSTOP)
        assert result().tokens == want
        wait_logged(d, "request silent-req: prefill on")
        wait_logged(d, "blocks set aside as silent-req#unconfirmed")
        s = d.stats()
        assert s.free_blocks < s.total_blocks and s.running_requests == 0, s  # set aside while unconfirmed
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    wait_logged(d, "request silent-req: " + victim.address + " answered", timeout_s=30)
    assert_idle(d, victim)


def test_a_silent_prefill_worker_that_leaves_the_deployment_frees_its_blocks(workers, reference):
    """The same silence in a deployment: once the controller's membership (SetPeers) no
    longer names the victim, it is known gone (the controller ends a worker's process
    before it replaces or removes it): the blocks set aside for it are free again while it
    is still frozen, its channel is closed, and a request that offers it is prefilled
    elsewhere without a call to it."""
    d, p, victim = workers.d, workers.p, workers.victim
    everyone = [w.address for w in (workers.p, workers.d, workers.victim, workers.small, workers.term)]
    rng = random.Random(13)
    prompt, other = random_prompt(rng, 450), random_prompt(rng, 40)
    want, want_other = reference([prompt, other], 8)
    d.stub.SetPeers(pb.SetPeersRequest(workers=everyone), timeout=10)
    result = generate_held_by(d, victim, prompt, [victim.address], "left-req")
    try:
        with stalled(workers.stall["victim"]):
            victim.proc.send_signal(signal.SIGSTOP)
        assert result().tokens == want
        wait_logged(d, "blocks set aside as left-req#unconfirmed")
        s = d.stats()
        assert s.free_blocks < s.total_blocks, s
        d.stub.SetPeers(pb.SetPeersRequest(workers=[a for a in everyone if a != victim.address]), timeout=10)
        wait_logged(d, f"request left-req: {victim.address} left the deployment; blocks set aside")
        wait_logged(d, f"prefill peer {victim.address} left the deployment: its channel closed")
        assert_idle(d)  # while the victim is still frozen
        assert generate(d, other, prefill=[victim.address], rid="left-offered").tokens == want_other
        wait_logged(d, f"prefill worker {victim.address} left out: not a worker of this deployment now")
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        d.stub.SetPeers(pb.SetPeersRequest(workers=everyone), timeout=10)
    assert_idle(d, victim)


def test_prefill_worker_killed_mid_request_moves_on_and_returns_every_block(workers, reference):
    d, p, victim = workers.d, workers.p, workers.victim
    rng = random.Random(4)
    prompt = random_prompt(rng, 450)
    [want] = reference([prompt], 8)
    result = generate_held_by(d, victim, prompt, [victim.address, p.address], "victim-req")
    with stalled(workers.stall["victim"]):  # freeze it mid-prefill, so the kill surely lands inside
        victim.kill()
    assert result().tokens == want  # moved to P, or prefilled locally
    wait_logged(d, f"request victim-req: prefill on {victim.address} failed", 60)  # a loaded host writes it late
    assert_idle(d, p)

    # With only the dead worker in the list, D prefills locally.
    prompt = random_prompt(rng, 120)
    [want] = reference([prompt], 8)
    assert generate(d, prompt, prefill=[victim.address], rid="dead-list").tokens == want
    wait_logged(d, "request dead-list: no prefill worker left")
    assert_idle(d, p)


def test_a_prefill_worker_shutting_down_stops_its_loop_before_its_server(workers, reference):
    """SIGTERM while `term` holds a request mid-prefill, its loop frozen: its gRPC server
    keeps answering until its loop has ended the
    request (push cancelled, reply sent) and stopped; only then does its address refuse
    connections, which D takes as proof that nothing is being written. The request
    completes on the next prefill worker, every block back."""
    d, p, term = workers.d, workers.p, workers.term
    # A prompt no worker holds: term computes all of it (with D holding it cached, term would
    # fetch its blocks from D and be done before the freeze).
    prompt = random_prompt(random.Random(913), 450)
    [want] = reference([prompt], 8)
    result = generate_held_by(d, term, prompt, [term.address, p.address], "term-req")
    with stalled(workers.stall["term"]):  # its loop cannot end the request while frozen
        term.proc.send_signal(signal.SIGTERM)
        wait_logged(term, "requests still held at SIGTERM: ending them")
        time.sleep(1.0)
        s = term.stats()  # the server still answers: the loop has not let go of the request yet
        assert s.running_requests + s.waiting_requests == 1, s
    assert result().tokens == want
    assert term.proc.wait(30) == 0
    log = term.log_path.read_text()
    assert log.index("request term-req: abort asked") < log.index(": stopped"), log[-2000:]
    wait_logged(d, f"request term-req: prefill on {term.address} failed")
    assert_idle(d, p)


# ---------------------------------------------------------------------------- 4. prefix cache

def test_decode_prefix_cache_hits_are_not_transferred(workers, reference):
    d, p = workers.d, workers.p
    rng = random.Random(5)
    k = 4
    first = random_prompt(rng, 6 * BLOCK + 5)
    second = first[:k * BLOCK] + random_prompt(rng, 3 * BLOCK + 2)
    want = reference([first, second], 8)

    t0 = d.stats().kv_blocks_transferred
    a = generate(d, first, prefill=[p.address])
    t1 = d.stats().kv_blocks_transferred
    b = generate(d, second, prefill=[p.address])
    t2 = d.stats().kv_blocks_transferred

    assert (a.tokens, b.tokens) == tuple(want)
    assert t1 - t0 == -(-len(first) // BLOCK)  # a cold cache: every block of the prompt
    assert t2 - t1 == -(-len(second) // BLOCK) - k  # the shared k blocks stayed at home
    assert a.usage.cached_prompt_tokens == 0
    assert b.usage.cached_prompt_tokens == k * BLOCK

    # D computed a prompt itself, P never saw it: only the block past D's cache is sent.
    third = random_prompt(rng, 5 * BLOCK + 3)
    [want] = reference([third], 8)
    assert generate(d, third).tokens == want
    t3 = d.stats().kv_blocks_transferred
    c = generate(d, third, prefill=[p.address])
    assert c.tokens == want
    assert d.stats().kv_blocks_transferred - t3 == 1
    assert c.usage.cached_prompt_tokens == 5 * BLOCK
    assert_idle(d, p)


# ---------------------------------------------------------------------------- 5. deep health

def test_a_stalled_engine_loop_fails_deep_health_once_past_its_stall_bound(workers):
    """D's floor is STALL_FLOOR_S (its steps are milliseconds, so the floor is its bound).
    A stalled loop answers every deep check within the call's deadline, and is judged
    wedged once it has made no progress for the bound, never by how long a probe waited."""
    d = workers.d
    h = d.stub.Health(pb.HealthRequest(deep=True), timeout=5)
    assert h.ok and not h.busy and h.stall_bound_s == STALL_FLOOR_S and h.longest_step_s > 0, h
    with stalled(workers.stall["d"]):
        verdicts = []

        def judged_wedged() -> bool:
            verdicts.append(d.stub.Health(pb.HealthRequest(deep=True), timeout=STALL_FLOOR_S))  # answers, or raises
            return not verdicts[-1].ok

        wait_until(judged_wedged, 60, "the stalled loop judged wedged")
        assert "wedged" in verdicts[-1].detail and f"{STALL_FLOOR_S:.1f}s" in verdicts[-1].detail, verdicts[-1]
        shallow = d.stub.Health(pb.HealthRequest(deep=False), timeout=2.0)
        assert shallow.ok and shallow.worker
    wait_until(lambda: d.stub.Health(pb.HealthRequest(deep=True), timeout=5).ok, 10, "deep health to recover")
    assert workers.p.stub.Health(pb.HealthRequest(deep=True), timeout=5).ok
    assert_idle(d)


# ---------------------------------------------------------------------------- 6. bad input

@pytest.mark.parametrize("params, field", [
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logit_bias={-3: 1.0}), "logit_bias"),
])
def test_invalid_sampling_params_are_refused_naming_the_field(workers, params, field):
    d, p = workers.d, workers.p
    sp = pb.SamplingParams(temperature=0, max_tokens=4)
    for name, value in params.items():
        if name == "logit_bias":
            sp.logit_bias.update(value)
        else:
            setattr(sp, name, value)
    for prefill in ([p.address], []):
        req = pb.GenerateRequest(request_id="bad", prompt_token_ids=[5, 6, 7], params=sp, prefill_workers=prefill)
        e = rpc_error(lambda: d.stub.Generate(req, timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert field in e.details(), e.details()
    assert_idle(d, p)


@pytest.mark.parametrize("what", ["prompt", "stop_token_ids", "logit_bias"])
def test_token_ids_outside_the_vocabulary_are_refused_and_the_batch_goes_on(workers, reference, what):
    """An id past the vocabulary would fail the embedding lookup or the sampler of a whole
    step (every request in it); the worker refuses it at admission, naming the field, and
    the request beside it is served as if it were alone. Both workers check: D's local path,
    and P, which a caller with the internal token can reach directly."""
    d, p = workers.d, workers.p
    rng = random.Random(21)
    good_prompt = random_prompt(rng, 40)
    [want] = reference([good_prompt], 8)
    vocab = 10**6  # far past any tiny model's vocabulary
    sp = pb.SamplingParams(temperature=0, max_tokens=4)
    prompt = [5, 6, 7]
    if what == "prompt":
        prompt = [5, vocab, 7]
    elif what == "stop_token_ids":
        sp.stop_token_ids.append(vocab)
    else:
        sp.logit_bias[vocab] = 1.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(generate, d, good_prompt, 8, [p.address])
        for prefill in ([p.address], []):
            req = pb.GenerateRequest(request_id=f"bad-{what}", prompt_token_ids=prompt, params=sp,
                                     prefill_workers=prefill)
            e = rpc_error(lambda: d.stub.Generate(req, timeout=10))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.details(), e.details()
        assert good.result(timeout=60).tokens == want
    direct = p.stub.Prefill(pb.PrefillRequest(request_id=f"bad-{what}-p", prompt_token_ids=prompt, params=sp),
                            timeout=10)
    assert direct.error.code == pb.INVALID_REQUEST and what in direct.error.message, direct
    assert_idle(d, p)


def test_a_prefill_into_blocks_the_destination_does_not_have_is_refused(workers):
    """P writes only where D's pool has blocks, each block once: a caller with the internal
    token naming block ids past D's pool (or one twice) gets INVALID_REQUEST, and no write."""
    d, p = workers.d, workers.p
    info = d.stub.TransferInfo(pb.TransferInfoRequest(), timeout=10).info
    name = json.loads(info)["agent_name"]
    sp = pb.SamplingParams(temperature=0, max_tokens=1)
    for blocks, words in (([KV_BLOCKS + 5, 1, 2], "outside"), ([3, 3, 4], "repeat")):
        req = pb.PrefillRequest(request_id=f"forged-{words}", prompt_token_ids=list(range(5, 5 + 3 * BLOCK)),
                                params=sp, destination=pb.KVDestination(agent_name=name, block_ids=blocks),
                                decode_transfer_info=info)
        reply = p.stub.Prefill(req, timeout=30)
        assert reply.error.code == pb.INVALID_REQUEST and words in reply.error.message, reply
    assert_idle(d, p)


def test_a_prefill_worker_writes_only_to_the_decode_agents_the_deployment_names(workers, reference):
    """Once the controller has named the deployment's decode agents (SetPeers), P refuses a
    destination of any other agent before it can touch a known peer: a forged identity (D's
    worker id, an incarnation from the far future) no longer replaces D's and locks D out.
    An agent dropped from the list is disconnected; D's requests then prefill locally, with
    the same tokens."""
    d, p = workers.d, workers.p
    info = d.stub.TransferInfo(pb.TransferInfoRequest(), timeout=10).info
    real = json.loads(info)["agent_name"]
    rng = random.Random(8)
    prompts = [random_prompt(rng, 3 * BLOCK + 2) for _ in range(3)]
    want = reference(prompts, 4)

    def transferred() -> int:
        return p.stub.Stats(pb.StatsRequest(), timeout=10).kv_blocks_transferred

    try:
        p.stub.SetPeers(pb.SetPeersRequest(decode_agents=[real]), timeout=10)
        forged_name = f"{real.rpartition('-')[0]}-99999999999999"
        forged = json.dumps({**json.loads(info), "agent_name": forged_name}).encode()
        req = pb.PrefillRequest(request_id="forged-identity", prompt_token_ids=prompts[0],
                                params=pb.SamplingParams(temperature=0, max_tokens=1),
                                destination=pb.KVDestination(agent_name=forged_name, block_ids=[1, 2, 3, 4]),
                                decode_transfer_info=forged)
        reply = p.stub.Prefill(req, timeout=30)
        assert reply.error.code == pb.INVALID_REQUEST and "not a decode worker of this deployment" in \
            reply.error.message, reply
        before = transferred()
        assert generate(d, prompts[1], 4, prefill=[p.address]).tokens == want[1]
        assert transferred() > before  # D is still P's peer: prefilled there
        assert "replaced by" not in p.log_path.read_text()

        p.stub.SetPeers(pb.SetPeersRequest(decode_agents=["decode-77-1"]), timeout=10)
        wait_until(lambda: f"peer {real} left the deployment" in p.log_path.read_text(), 30, "D disconnected")
        before = transferred()
        assert generate(d, prompts[2], 4, prefill=[p.address]).tokens == want[2]  # prefilled on D itself
        assert transferred() == before
    finally:
        p.stub.SetPeers(pb.SetPeersRequest(decode_agents=[real]), timeout=10)
    assert_idle(d, p)


def test_requests_that_cannot_fit_are_refused(workers):
    d, p = workers.d, workers.p
    rng = random.Random(6)
    too_long = generate_request(random_prompt(rng, 500), 20, [p.address])
    e = rpc_error(lambda: d.stub.Generate(too_long, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.details(), e
    e = rpc_error(lambda: d.stub.Generate(generate_request([], 4, [p.address]), timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty prompt" in e.details(), e
    # Exactly at the context limit is fine (and finishes by length).
    fits = generate(d, random_prompt(rng, CONTEXT - 4), max_tokens=4, prefill=[p.address], ignore_eos=True)
    assert (len(fits.tokens), fits.finish) == (4, pb.LENGTH)
    assert_idle(d, p)


def test_a_replay_takes_its_kv_from_wherever_it_can_and_continues_exactly(workers, reference):
    """A replay (gateway/decode_stream.py) names the tokens it streamed; the KV of all but the
    last comes from its kv_source (a drained decode worker that kept it), else the prefill
    worker (which samples a token the replay does not take), else a local prefill, and the
    last is decoded next: every way gives transformers' tokens. A kv_source that keeps
    nothing refuses the copy and the next way is taken; a decode worker prefills for no one."""
    d, p = workers.d, workers.p
    prompt = random_prompt(random.Random(11), 2 * BLOCK + 7)
    (want,) = reference([prompt], 14)
    head = want[:min(6, len(want) - 1)]  # 6 streamed: the KV of 44 tokens, the last of them decoded next
    before = d.log_path.read_text(errors="replace").count("pull refused")
    ways = (((p.address,), d.address), ((), d.address), ((p.address,), ""), ((), ""))
    for i, (prefill, source) in enumerate(ways):
        req = generate_request(prompt, 14, list(prefill), rid=f"replay-{i}")
        req.output_token_ids[:] = head
        if source:  # D itself, which keeps nothing under this id
            req.kv_source.CopyFrom(pb.KVSource(address=source, request_id="kept-nowhere"))
        tokens, final = [], None
        for msg in d.stub.Generate(req, timeout=RPC_TIMEOUT_S):
            tokens.extend(msg.token_ids)
            final = msg
        assert final.error.code == pb.ERROR_NONE, final.error
        assert tokens == want[len(head):], (prefill, source)
        assert final.usage.completion_tokens == len(tokens) and final.usage.cached_prompt_tokens <= len(prompt)
    assert d.log_path.read_text(errors="replace").count("pull refused") == before + 2
    info = d.stub.TransferInfo(pb.TransferInfoRequest(), timeout=10).info
    name = json.loads(info)["agent_name"]
    as_prefill = pb_grpc.PrefillWorkerStub(auth.channel(d.address))
    plain = pb.PrefillRequest(request_id="not-a-pull", prompt_token_ids=prompt, params=pb.SamplingParams(max_tokens=1),
                              destination=pb.KVDestination(agent_name=name, block_ids=[1, 2, 3]),
                              decode_transfer_info=info)
    reply = as_prefill.Prefill(plain, timeout=30)
    assert reply.error.code == pb.INVALID_REQUEST and "prefills for no one" in reply.error.message, reply
    plain.kv_request_id = "kept-nowhere"
    reply = as_prefill.Prefill(plain, timeout=30)
    assert reply.error.code == pb.INVALID_REQUEST and "not kept here" in reply.error.message, reply
    assert_idle(d, p)


def test_request_id_still_in_flight_is_refused(workers, reference):
    """An id whose blocks wait for P's abort confirmation is still taken: a retry under the
    same id must not share (and later free) the blocks of the cancelled attempt."""
    d, p = workers.d, workers.p
    rng = random.Random(9)
    prompt = random_prompt(rng, 90)
    [want] = reference([prompt], 8)
    assert generate(d, prompt).tokens == want  # now in D's prefix cache
    with stalled(workers.stall["p"]):
        call = d.stub.Generate(generate_request(prompt, 8, [p.address], rid="dup"), timeout=RPC_TIMEOUT_S)
        wait_logged(d, "request dup: prefill on")
        e = rpc_error(lambda: d.stub.Generate(generate_request(prompt, 8, rid="dup"), timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "duplicate" in e.details(), e
        call.cancel()
        wait_logged(d, "request dup: cancelled")
        e = rpc_error(lambda: d.stub.Generate(generate_request(prompt, 8, rid="dup"), timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "duplicate" in e.details(), e
    assert_idle(d, p)
    assert generate(d, prompt, rid="dup").tokens == want  # free again once P confirmed
    assert_idle(d, p)


def test_full_queue_is_resource_exhausted_and_leaks_nothing(workers, reference):
    small = workers.small  # one running sequence, one waiting slot
    rng = random.Random(7)
    running = small.stub.Generate(generate_request(random_prompt(rng, 8), 480, rid="q-running", ignore_eos=True),
                                  timeout=RPC_TIMEOUT_S)
    try:
        next(running)  # it runs: the one sequence slot is taken
        queued_prompt = random_prompt(rng, 8)
        waiting = small.stub.Generate(generate_request(queued_prompt, 6, rid="q-waiting"), timeout=RPC_TIMEOUT_S)
        wait_until(lambda: small.stats().waiting_requests == 1, 10, "the second request to queue")
        e = rpc_error(lambda: small.stub.Generate(generate_request(random_prompt(rng, 8), 4, rid="q-refused"),
                                                  timeout=10))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert "q-refused" in e.details()
    finally:
        running.cancel()
    # The queued one runs once the slot frees, and matches the reference.
    assert [t for msg in waiting for t in msg.token_ids] == reference([queued_prompt], 6)[0]
    assert_idle(small)
    # A --no-transfer worker given prefill workers prefills locally, with the same result.
    prompt = random_prompt(rng, 50)
    [want] = reference([prompt], 8)
    assert generate(small, prompt, prefill=[workers.p.address]).tokens == want
    assert_idle(small)


def test_a_worker_without_the_internal_token_listens_on_loopback_only(model, tmp_path):
    """With no PDSERVE_INTERNAL_TOKEN a worker checks no caller, so it refuses an address
    other machines reach, at once and saying why; with the token it serves there."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    cmd = [sys.executable, "-m", "decode", "--model", str(model), "--dtype", "float64", "--kv-blocks", "16",
           "--no-transfer", "--host", "0.0.0.0", "--port", "0"]
    refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "refusing to listen on 0.0.0.0 without PDSERVE_INTERNAL_TOKEN" in refused.stderr
    (w,) = start_workers([("decode", ["--dtype", "float64", "--kv-blocks", "16", "--no-transfer", "--host", "0.0.0.0"],
                           {"PDSERVE_INTERNAL_TOKEN": "t0ken"})], model, tmp_path)
    try:
        assert w.address.startswith("0.0.0.0:")
    finally:
        w.stop()
