"""The workers' step-by-step bookkeeping, in this process: a DecodeWorker or PrefillWorker
driven one engine step at a time (no loop thread, no gRPC server) over a tiny float64 model,
with a transfer agent that only keeps books (decode) or the fake NIXL of tests/transfer/fake_nixl.py
(prefill), so a test decides exactly when a Prefill is sent, a write completes or a push
fails. What these pin down: when a Prefill goes out within a step, that NIXL progresses
during steps, and that no failure between reservation and reply strands a request or a
block. The same paths over real processes and real NIXL are in tests/worker/test_workers.py and
tests/e2e/test_chaos.py.
"""

from __future__ import annotations

import collections
import queue
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

import prefill.worker as prefill_worker
import worker.destination as destination
from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import wait_until
from common.sampling_params import SamplingParams
from decode.remote_prefill_state import Phase
from decode.step_batches import Outlet, StepBatches, responses
from decode.worker import DecodeWorker
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, StepResult
from rpc import pdserve_pb2 as pb
from tests.transfer.fake_nixl import fake_agent
from transfer.messages import Notification, NotifKind

BLOCK = 16
BUDGET = 32  # tokens per step: longer prompts are prefilled in chunks
CONTEXT = 512  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama-gqa", seed=7)


def _prefill_worker(engine: LLMEngine, monkeypatch) -> tuple[prefill_worker.PrefillWorker, object]:
    """A PrefillWorker over the fake NIXL, whose only peer is decode-0-1 (no handshake)."""
    agent = fake_agent()
    monkeypatch.setattr(agent, "add_peer", lambda info: "decode-0-1", raising=False)
    peer = SimpleNamespace(agent_name="decode-0-1", layout=SimpleNamespace(num_blocks=64))
    monkeypatch.setattr(destination.TransferInfo, "from_bytes", staticmethod(lambda blob: peer))
    return prefill_worker.PrefillWorker(engine, agent), agent



class Inbox(Outlet):
    """One request's messages as the decode worker delivers them (its outlet on a call of its
    own), read like a queue of GenerateResponses."""

    def __init__(self):
        super().__init__(StepBatches(), 0, None)
        self._read: collections.deque = collections.deque()

    def get(self, timeout: float | None = None) -> pb.GenerateResponse:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._read:
            left = 0.0 if deadline is None else deadline - time.monotonic()
            if deadline is not None and left <= 0:
                raise queue.Empty
            down = self.batches.take(min(left, 0.5) if deadline is not None else 0.5)
            if down is not None:
                self._read.extend(responses(down))
        return self._read.popleft()

    def get_nowait(self) -> pb.GenerateResponse:
        if self.empty():
            raise queue.Empty
        return self._read.popleft()

    def empty(self) -> bool:
        if not self._read:
            down = self.batches.take(0)
            if down is not None:
                self._read.extend(responses(down))
        return not self._read


class _BookkeepingAgent:
    """Just enough of a TransferAgent for DecodeWorker's bookkeeping: no notification ever comes."""

    name = "decode-9-1"
    polls = 0

    def info(self):
        return SimpleNamespace(to_bytes=lambda: b"")

    def poll_notifications(self) -> list:
        self.polls += 1
        return []


def test_a_prefill_goes_out_before_the_forward_pass_and_transfers_progress_during_steps(model):
    """The step that reserves a remote prefill's blocks sends its Prefill before computing
    (not one whole step later), and while remote KV is awaited every layer of a step drives
    NIXL (a prefill worker's push completes only when this side makes progress)."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    agent = _BookkeepingAgent()
    worker = DecodeWorker(engine, "decode-test", agent)
    out = Inbox()
    sent_before_compute = []
    execute = engine.runner.execute

    def watched(batch):
        sent_before_compute.append(worker.remote["r"].rpc is not None)
        return execute(batch)

    engine.runner.execute = watched
    worker.add("local", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8), 0, [], out, 5.0)
    worker.add("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4), 0, ["127.0.0.1:1"], out, 5.0)
    worker.step()  # reserves r's blocks, and prefills "local" beside it
    assert sent_before_compute == [True]
    polls = agent.polls
    worker.step()  # "local" decodes while r's KV is awaited
    assert agent.polls - polls == engine.model.cfg.num_layers
    worker.cancel("r")
    worker.cancel("local")


def test_cancel_between_reservation_and_prefill_request_keeps_the_loop_alive(model):
    """A cancel drained in the loop iteration right after the step that reserved the blocks
    (before poll() sends the Prefill) used to raise KeyError in poll(), ending the loop thread."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker = DecodeWorker(engine, "decode-test", _BookkeepingAgent())
    out = Inbox()
    dead = "127.0.0.1:1"  # nothing listens: the Abort fails UNAVAILABLE, so nothing can be writing
    worker.add("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4), 0, [dead], out, 5.0)
    scheduled = engine.schedule()  # reserves the prompt's blocks for the remote prefill
    worker.cancel("r")  # the gap this test is about: the cancel comes before the Prefill goes out
    assert out.get_nowait().finish_reason == pb.ABORT
    worker.on_scheduled(scheduled)
    engine.execute(scheduled)

    def aborted() -> bool:
        worker.poll()  # what the loop would do next: before the fix, KeyError here
        return not worker.remote

    wait_until(aborted, 10, "the Abort's answer")
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    assert not engine.has_unfinished() and not engine.scheduler.held


def test_a_push_that_fails_mid_prompt_stops_the_prefill_and_frees_its_blocks(model, monkeypatch):
    """The push of a prompt still being prefilled in chunks fails (here: its timeout, as a
    stuck link would): the prefill worker must stop computing it and free its blocks. It used
    to release them at once, while the request still ran, so they were held for good when it
    finished (the chaos suite's storm found 48 such blocks)."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker, agent = _prefill_worker(engine, monkeypatch)  # its writes can only time out
    prompt = list(range(3, 3 + 4 * BUDGET))  # four chunks, one per step
    destination = pb.KVDestination(agent_name="decode-0-1", block_ids=list(range(len(prompt) // BLOCK)))
    req = pb.PrefillRequest(request_id="r", prompt_token_ids=prompt, destination=destination)
    reply: Future = Future()
    worker.add(req, SamplingParams(temperature=0, max_tokens=4), reply, timeout_s=0.2)
    worker.step()  # the first chunk is computed, and its blocks pushed
    time.sleep(0.3)
    assert worker.poll() and reply.result(0).error.code == pb.KV_TRANSFER_FAILED
    while engine.has_unfinished():
        worker.step()
    assert not engine.scheduler.held
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def _sample(name: str, **labels: str) -> float:
    """A counter of this process's registry (the decode worker's metrics, decode/metrics.py)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_prefill_that_cannot_be_sent_is_prefilled_locally_and_strands_no_other(model):
    """Two remote prefills reserved in one step; sending the first raises. It is prefilled
    locally at once, the second still goes out, and nothing waits with reserved blocks."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 64), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker = DecodeWorker(engine, "decode-test", _BookkeepingAgent())
    out = Inbox()
    params = SamplingParams(temperature=0, max_tokens=4)
    counted = {"remote": _sample("pdserve_prefills_total", where="remote"),
               "send_failed": _sample("pdserve_prefill_fallbacks_total", cause="send_failed")}
    worker.add("a", list(range(3, 43)), params, 0, ["127.0.0.1:1"], out, 5.0)
    worker.add("b", list(range(50, 90)), params, 0, ["127.0.0.1:1"], out, 5.0)
    send = worker.remote._send_prefill

    def first_fails(state, *args):
        if state.request_id == "a":
            raise RuntimeError("channel refused")
        return send(state, *args)

    worker.remote._send_prefill = first_fails
    worker.step()  # reserves both; the hook sends them
    assert "a" not in worker.remote and "a" not in engine.scheduler.awaiting_kv  # back to local prefill
    assert worker.remote["b"].rpc is not None
    assert _sample("pdserve_prefills_total", where="remote") == counted["remote"] + 2
    assert _sample("pdserve_prefill_fallbacks_total", cause="send_failed") == counted["send_failed"] + 1
    worker.cancel("b")
    while engine.has_unfinished():  # "a" is prefilled and decoded here
        worker.step()
    tokens, served = [], []
    while not out.empty():
        msg = out.get_nowait()
        tokens += list(msg.token_ids)
        served += [msg.served] if msg.HasField("served") else []
    assert len(tokens) == 4  # a's four tokens ("b" was cancelled before any)
    # a's first message says it was prefilled here, and why (the gateway's answer headers repeat it)
    assert [(s.prefill_worker, s.kv_blocks, s.local_prefill) for s in served] == [("", 0, pb.LOCAL_PREFILL_SEND_FAILED)]


def test_a_request_preempted_on_the_prefill_worker_is_aborted_once_its_writes_are_done(model, monkeypatch):
    """KV full on a prefill worker: the scheduler preempts a request whose blocks pushes may
    still be reading. Its writes can no longer be trusted, so it is aborted: the reply (an
    error, so the decode worker prefills it elsewhere) comes only once nothing of it is in
    flight, and every block comes back."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 10), SchedulerConfig(64, 8, CONTEXT))
    worker, agent = _prefill_worker(engine, monkeypatch)
    replies = {}
    for i, rid in enumerate(["first", "second"]):  # 6 blocks each, 10 in the pool
        prompt = list(range(3 + 100 * i, 3 + 100 * i + 6 * BLOCK))
        req = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                destination=pb.KVDestination(agent_name="decode-0-1", block_ids=list(range(6))))
        replies[rid] = Future()
        worker.add(req, SamplingParams(temperature=0, max_tokens=4), replies[rid], timeout_s=30.0)
    preempted: list[str] = []
    while "second" not in preempted:
        worker.poll()
        preempted = worker.step().preempted
    second_writes = [x for x in agent.nixl.made if x.state == "PROC"]
    assert second_writes and not replies["second"].done()  # its writes are still in flight
    for _ in range(3):  # complete every write, the ones posted after earlier ones too
        for x in agent.nixl.made:
            x.state = "DONE"
        worker.poll()
    assert replies["second"].result(0).error.code == pb.CANCELLED
    assert replies["first"].result(0).error.code == pb.ERROR_NONE
    assert not engine.has_unfinished() and not engine.scheduler.held
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_the_remote_prefill_budget_follows_the_measured_prefill_rate(model):
    """`--prefill-timeout` is the floor; a prompt this worker measured itself needing longer
    for (its warm-up step's rate, a slow host's included) gets 10x that time instead."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker = DecodeWorker(engine, "decode-test", _BookkeepingAgent(), prefill_timeout_s=5.0)
    assert worker.remote_prefill_budget_s(10**6) == 5.0  # nothing measured yet: the floor
    worker.warm_up()
    rate = worker.liveness.prefill_tokens_per_s
    assert rate > 0
    assert worker.remote_prefill_budget_s(1) == 5.0
    big = int(rate * 2)  # two seconds of this worker's prefill
    assert worker.remote_prefill_budget_s(big) == pytest.approx(max(5.0, 10 * big / rate))
    out = Inbox()
    worker.add("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4), 0, ["127.0.0.1:1"], out, 600.0)
    assert worker.remote["r"].deadline - time.monotonic() <= worker.remote_prefill_budget_s(40) + 0.1


class _Pending:
    """A Prefill call that never answers (its worker is slow): only notifications move things."""

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        return True


def test_a_late_notification_of_an_earlier_attempt_matches_nothing(model, monkeypatch):
    """Each attempt's KV notifications carry a transfer id of its own (request, attempt,
    nonce). A notification of attempt 1 that arrives while attempt 2 waits, or one with the
    bare request id (another agent guessing), neither fails nor completes attempt 2; only
    attempt 2's own completes it."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    agent = _BookkeepingAgent()
    inbox: list = []
    agent.poll_notifications = lambda: [inbox.pop(0) for _ in range(len(inbox))]
    worker = DecodeWorker(engine, "decode-test", agent)
    sent = []
    monkeypatch.setattr(worker.remote, "_stub", lambda address: SimpleNamespace(
        Prefill=SimpleNamespace(future=lambda req, timeout: sent.append(req) or _Pending()),
        Abort=SimpleNamespace(future=lambda req, timeout: _Pending())))
    out = Inbox()
    worker.add("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4), 0,
               ["127.0.0.1:1", "127.0.0.1:2"], out, 30.0)
    worker.step()  # reserves r's blocks and sends attempt 1
    state = worker.remote["r"]
    first = state.transfer_id
    assert sent[-1].transfer_id == first and first.startswith("r.0.")
    state.attempt += 1  # attempt 1 failed and was confirmed aborted: attempt 2 goes out
    worker.remote._send_prefill(state, state.reserved)
    second = state.transfer_id
    assert second != first and sent[-1].transfer_id == second
    inbox += [Notification("prefill-0-1", NotifKind.ABORT, first), Notification("prefill-0-1", NotifKind.DONE, first, 3),
              Notification("prefill-9-9", NotifKind.ABORT, "r")]
    worker.poll()
    assert state.phase is Phase.PREFILLING and not state.failures and not state.kv_complete
    inbox.append(Notification("prefill-1-1", NotifKind.DONE, second, 3))
    worker.poll()
    assert state.kv_complete and not state.failures
    worker.cancel("r")


def test_an_abort_that_comes_before_its_prefill_refuses_the_prefill(model, monkeypatch):
    """The decode worker's Abort can reach the prefill worker's loop before that request's
    Prefill is added: it answers "not found" (nothing in flight), the decode worker reuses
    the blocks, and the late Prefill must then be refused, not pushed into them."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker, agent = _prefill_worker(engine, monkeypatch)
    confirmed: Future = Future()
    worker.abort("late", confirmed)
    assert confirmed.result(0) is False  # not found: the decode worker frees the blocks
    prompt = list(range(3, 3 + 2 * BLOCK))
    req = pb.PrefillRequest(request_id="late", prompt_token_ids=prompt,
                            destination=pb.KVDestination(agent_name="decode-0-1", block_ids=[0, 1]))
    with pytest.raises(ValueError, match="aborted before"):
        worker.add(req, SamplingParams(temperature=0, max_tokens=4), Future(), timeout_s=30.0)
    assert not engine.has_unfinished() and not agent.nixl.made  # nothing computed, nothing written
    other = pb.PrefillRequest(request_id="other", prompt_token_ids=prompt,
                              destination=pb.KVDestination(agent_name="decode-0-1", block_ids=[0, 1]))
    worker.add(other, SamplingParams(temperature=0, max_tokens=4), Future(), timeout_s=30.0)  # others go on
    assert engine.has_unfinished()


def test_steps_that_keep_failing_end_every_request_with_an_error_and_the_worker_recovers(model):
    """A step that raises every time (here: the forward pass) used to hang every request of
    the worker while deep health said healthy. After a few failed iterations in a row each
    request ends with an INTERNAL error, deep health says why while it lasts, and once the
    fault is gone the worker serves again."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker = DecodeWorker(engine, "decode-test")
    execute, broken = engine.runner.execute, [True]

    def failing(batch):
        if broken[0]:
            raise RuntimeError("injected: the forward pass fails")
        return execute(batch)

    engine.runner.execute = failing
    poll = worker.poll

    def failing_poll() -> bool:  # every iteration fails while broken, idle ones too: health can see it
        if broken[0]:
            raise RuntimeError("injected: the forward pass fails")
        return poll()

    worker.poll = failing_poll
    worker.start()
    try:
        outs = [Inbox() for _ in range(2)]
        for i, out in enumerate(outs):
            worker.submit(lambda i=i, out=out: worker.add(f"r{i}", list(range(3 + i, 20 + i)),
                                                          SamplingParams(temperature=0, max_tokens=4), 0, [], out, 5.0))
        for out in outs:  # bounded: a few iterations of a loop that fails at once
            msg = out.get(timeout=60)
            assert msg.finish_reason == pb.ERROR and msg.error.code == pb.INTERNAL and "injected" in msg.error.message
        wait_until(lambda: not engine.has_unfinished(), 30, "the engine emptied")
        verdict = worker.health(5.0)  # while the iterations fail: deep health says so
        assert not verdict.ok and "engine steps are failing" in verdict.detail and "injected" in verdict.detail
        broken[0] = False
        done = Inbox()
        worker.submit(lambda: worker.add("after", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2), 0, [],
                                         done, 5.0))
        tokens, msg = [], done.get(timeout=60)
        while True:
            tokens += list(msg.token_ids)
            if msg.finish_reason != pb.FINISH_NONE:
                break
            msg = done.get(timeout=60)
        assert len(tokens) == 2 and msg.error.code == pb.ERROR_NONE
        assert worker.health(5.0).ok
    finally:
        worker.stop()


def test_a_step_that_fails_still_reports_what_its_schedule_preempted(model, monkeypatch):
    """The schedule preempts a request (its blocks go back to the pool) and then the forward
    pass raises: the prefill worker must still abort that request's push, whose writes would
    otherwise go on reading blocks that are no longer its own."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker, agent = _prefill_worker(engine, monkeypatch)
    replies = {}
    for i, rid in enumerate(["first", "second"]):
        prompt = list(range(3 + 100 * i, 3 + 100 * i + 4 * BLOCK))
        req = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                destination=pb.KVDestination(agent_name="decode-0-1", block_ids=list(range(4))))
        replies[rid] = Future()
        worker.add(req, SamplingParams(temperature=0, max_tokens=4), replies[rid], timeout_s=30.0)
    schedule = engine.scheduler.schedule

    def preempting_schedule():
        out = schedule()
        if "second" in {c.seq.request_id for c in out.chunks}:  # as when its blocks go to another
            out.chunks = [c for c in out.chunks if c.seq.request_id != "second"]
            engine.scheduler.abort("second")
            out.preempted.append("second")
        return out

    def failing(batch):
        raise RuntimeError("injected: the forward pass fails")

    monkeypatch.setattr(engine.scheduler, "schedule", preempting_schedule)
    monkeypatch.setattr(engine.runner, "execute", failing)
    with pytest.raises(RuntimeError):
        worker.step()
    worker.poll()
    assert replies["second"].done() and replies["second"].result(0).error.code == pb.CANCELLED  # its push stopped
    assert not replies["first"].done()


def test_a_gpu_steps_kv_is_pushed_only_after_its_kernels(model, monkeypatch):
    """On a GPU a step that samples no row (a middle chunk) returns before its kernels end:
    the prefill worker waits on the event the engine recorded after them before it posts the
    chunk's writes. The event is a stand-in here that records when it was waited on; on CPU
    there is none, and nothing waits."""
    import engine.llm_engine as llm_engine

    assert llm_engine._kv_written_event(False) is None
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker, agent = _prefill_worker(engine, monkeypatch)
    waited: list[int] = []  # writes already made when each step's event was waited on

    class Event:
        def synchronize(self) -> None:
            waited.append(len(agent.nixl.made))

    monkeypatch.setattr(llm_engine, "_kv_written_event", lambda on_cuda: Event())
    prompt = list(range(3, 3 + 4 * BUDGET))  # four chunks, one per step
    req = pb.PrefillRequest(request_id="r", prompt_token_ids=prompt,
                            destination=pb.KVDestination(agent_name="decode-0-1", block_ids=list(range(8))))
    worker.add(req, SamplingParams(temperature=0, max_tokens=4), Future(), timeout_s=30.0)
    worker.step()  # the first chunk: nothing sampled, its two blocks pushed
    assert waited == [0] and len(agent.nixl.made) > 0, (waited, agent.nixl.made)
    made = len(agent.nixl.made)
    worker.step()
    assert waited == [0, made] and len(agent.nixl.made) > made
    worker.abort("r")
    for x in agent.nixl.made:
        x.state = "DONE"
    while engine.has_unfinished() or worker.requests:
        worker.poll()
        worker.step()


def test_a_pull_waits_for_the_last_steps_kv_writes_before_it_pushes(model, monkeypatch):
    """A taker's pull (kept KV, or prompt blocks for a sibling) pushes blocks the steps wrote:
    on a GPU the last step may still be writing them, so the pull waits for its KV writes
    first, as a prefill worker does before its pushes (on CPU the wait is a no-op: here a
    recorder stands in for the step's CUDA event)."""
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(BLOCK, 32), SchedulerConfig(BUDGET, 8, CONTEXT))
    worker = DecodeWorker(engine, "decode-test", _BookkeepingAgent())
    worker.add("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2), 0, [], Inbox(), 5.0)
    order = []
    worker.step()
    monkeypatch.setattr(StepResult, "wait_kv_written", lambda result: order.append("written"))
    monkeypatch.setattr(worker.source, "pull", lambda req, reply, timeout_s: order.append("kept KV pushed"))
    monkeypatch.setattr(worker, "_pull_prefix", lambda req, reply, timeout_s: order.append("prefix pushed"))
    worker.pull(pb.PrefillRequest(request_id="t1", kv_request_id="a"), Future(), 5.0)
    worker.pull(pb.PrefillRequest(request_id="t2", prefix_only=True), Future(), 5.0)
    assert order == ["written", "kept KV pushed", "written", "prefix pushed"]
