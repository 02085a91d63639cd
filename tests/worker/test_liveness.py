"""Deep health judges progress, not a probe's queueing time (worker/liveness.py).

A busy worker that keeps completing steps is alive however slow its steps are; a worker
with work whose loop completes no step for its stall bound is wedged; an idle worker is
judged by a real probe through its loop. The engine loops here are real threads over a
tiny model; the slow host is the PDSERVE_FAULT_SLOW_FACTOR fault, the wedge the stall file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import wait_until
from common import envs
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, StepStats
from worker.liveness import Liveness
from worker.loop import EngineLoop


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama-gqa", seed=3)


def _loop(model: Path, floor_s: float = 10.0, budget: int = 64) -> EngineLoop:
    engine = LLMEngine.from_folder(model, "float32", CacheConfig(16, 64), SchedulerConfig(budget, 8, 512))
    loop = EngineLoop(engine, stall_floor_s=floor_s)
    loop.name = "decode-0-1"
    return loop


def _add(loop: EngineLoop, rid: str, max_tokens: int) -> None:
    loop.submit(lambda: loop.engine.add_request(rid, list(range(3, 40)),
                                                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))


def test_the_stall_bound_is_derived_from_the_longest_measured_step_with_a_floor():
    live = Liveness(floor_s=2.0, factor=10.0, window=4)
    assert live.bound_s == 2.0  # nothing measured: the floor
    live.warmed_up(0.5, 64)
    assert live.bound_s == pytest.approx(5.0)  # 10x the warm-up step
    for s in (0.01, 0.9, 0.01, 0.01):
        live.stepped(s)
    assert live.bound_s == pytest.approx(9.0)  # a longer step seen since
    for s in (0.01,) * 4:
        live.stepped(s)  # the 0.9 s step left the window; the warm-up still counts
    assert live.bound_s == pytest.approx(5.0)
    live.last_progress = time.monotonic() - 6.0
    v = live.judge_busy(queued=3)
    assert not v.ok and v.busy and v.queued == 3 and "no step completed" in v.detail
    live.stepped(0.01)
    assert live.judge_busy(queued=3).ok


def test_warm_up_measures_a_full_budget_step_and_touches_no_request_block(model):
    loop = _loop(model)
    free = loop.engine.kv_manager.num_free_blocks
    seconds = loop.warm_up()
    assert seconds > 0 and loop.liveness.longest_step_s == seconds
    assert loop.engine.kv_manager.num_free_blocks == free and not loop.engine.has_unfinished()


def test_an_idle_worker_is_judged_by_a_probe_through_its_loop(model):
    loop = _loop(model)
    loop.warm_up()
    loop.start()
    try:
        v = loop.health(5.0)
        assert v.ok and not v.busy, v
    finally:
        loop.stop()


def test_a_slow_busy_worker_is_alive_however_long_its_queue(model, monkeypatch):
    """Steps stretched 20x (a much slower host) and a queue of requests: a probe queued
    behind them would miss a short deadline, but the verdict reads the last completed step."""
    monkeypatch.setenv(envs.FAULT_SLOW_FACTOR, "20")
    loop = _loop(model)
    loop.warm_up()
    loop.start()
    try:
        for i in range(6):
            _add(loop, f"r{i}", 200)
        wait_until(lambda: loop.engine.scheduler.num_running > 0, 60, "a request running")
        for _ in range(5):
            v = loop.health(0.01)  # far shorter than one step: no probe could make it
            assert v.ok and v.busy and v.queued > 0, v
            time.sleep(0.2)
    finally:
        for i in range(6):
            loop.submit(lambda i=i: loop.engine.abort_request(f"r{i}"))
        loop.stop()


@pytest.mark.parametrize("busy", [True, False], ids=["with-work", "idle"])
def test_a_wedged_loop_is_judged_wedged_after_its_stall_bound(model, tmp_path, monkeypatch, busy):
    stall = tmp_path / "stall"
    monkeypatch.setenv(envs.FAULT_STALL_FILE, str(stall))
    loop = _loop(model, floor_s=1.0)
    loop.warm_up()
    loop.start()
    try:
        if busy:
            _add(loop, "r", 400)
            wait_until(lambda: loop.engine.scheduler.num_running > 0, 60, "a request running")
        assert loop.health(0.5).ok
        stall.write_text("decode-0-1")  # the loop blocks at its next iteration
        time.sleep(0.2)
        # within the bound it is not judged yet (a long step looks the same)
        wait_until(lambda: not loop.health(0.1).ok, 60, "the wedge judged")
        v = loop.health(0.1)
        assert v.busy == busy and "wedged" in v.detail, v
        assert v.last_step_age_s > v.stall_bound_s or not busy
        stall.unlink()
        wait_until(lambda: loop.health(2.0).ok, 60, "alive again")  # progress again: alive again
    finally:
        if stall.exists():
            stall.unlink()
        loop.submit(lambda: loop.engine.abort_request("r"))
        loop.stop()


def test_the_slow_factor_stretches_each_step(model, monkeypatch):
    monkeypatch.setenv(envs.FAULT_SLOW_FACTOR, "3")
    loop = _loop(model)
    inner = []
    warm_up = loop.engine.warm_up

    def timed() -> int:  # the step's own duration, as the engine took it
        t0 = time.perf_counter()
        tokens = warm_up()
        inner.append(time.perf_counter() - t0)
        return tokens

    loop.engine.warm_up = timed
    seconds = loop.warm_up()
    assert seconds >= 3 * inner[0] and loop.liveness.longest_step_s == seconds
    # What the worker reports of a step (metrics, Stats) is stretched alike: the planner reads it.
    assert loop.reported(StepStats(8, 1, 0.02)).seconds == pytest.approx(0.06) and loop.reported(None) is None
    monkeypatch.setenv(envs.FAULT_SLOW_FACTOR, "0.5")
    with pytest.raises(ValueError, match="must be a number >= 1"):
        _loop(model)


def test_the_step_floor_makes_each_working_step_last_at_least_it(model, monkeypatch):
    """PDSERVE_FAULT_STEP_FLOOR_S: a step that ran tokens lasts at least the floor whatever
    the host's speed; an iteration that ran nothing is not held back."""
    monkeypatch.setenv(envs.FAULT_STEP_FLOOR_S, "0.3")
    loop = _loop(model)
    assert loop.warm_up() >= 0.3 and loop.liveness.longest_step_s >= 0.3
    t0 = time.perf_counter()
    assert loop._stretch(t0, 0) < 0.3
    assert loop._stretch(time.perf_counter(), 5) >= 0.3
    assert loop.reported(StepStats(5, 1, 0.01)).seconds == 0.3 and loop.reported(StepStats(0, 0, 0.01)).seconds == 0.01
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(envs.FAULT_STEP_FLOOR_S, bad)
        with pytest.raises(ValueError, match="must be a number of seconds >= 0"):
            _loop(model)


def test_the_floor_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        Liveness(floor_s=0)


def test_a_call_that_runs_past_its_wait_is_answered_with_what_it_did(model):
    """EngineLoop.call gives up waiting only on a command the loop has not started: one
    already running (an admit the loop took just as the wait ran out) is waited for and its
    result returned, so the caller never answers "not admitted" for a request that was."""
    import threading
    import time

    loop = _loop(model)
    loop.start()
    try:
        ran = threading.Event()

        def slow_admit() -> str:
            ran.set()
            time.sleep(0.5)  # longer than the caller's wait below
            return "admitted"

        assert loop.call(slow_admit, timeout=0.05) == "admitted" and ran.is_set()
        gate = threading.Event()
        loop.submit(gate.wait)  # the loop is busy: the next command cannot start in time
        with pytest.raises(TimeoutError):
            loop.call(lambda: "late", timeout=0.05)
        gate.set()
        assert loop.call(lambda: "next", timeout=30) == "next"  # the cancelled one never ran; others do
    finally:
        loop.stop()
