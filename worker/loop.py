"""The engine loop of a worker process: one thread owns the engine (and its NIXL agent).

gRPC handler threads never touch the engine: they `submit` a function that runs on the
loop thread between steps, or `call` one and wait for its result. Each iteration runs
the queued commands, the worker's `poll` hook (transfers, RPC futures), then one engine
step if there is work; with nothing to do it sleeps on the command queue for a
millisecond, so an idle worker costs no CPU but still polls its transfers.

Each completed step is recorded in `liveness` (worker/liveness.py): deep health judges a
busy worker by how long ago it last completed a step, against a bound derived from its
own step times, and an idle one by a real probe through the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from common import envs, trace
from engine.kv_events import KVEventBatch
from engine.llm_engine import LLMEngine, StepResult, StepStats
from engine.parallel.rank_clock import StragglerWatch
from engine.scheduler import SchedulerOutput
from worker import kv_disk_metrics, metrics, moe_metrics, step_log
from worker.holdings import Holdings, loop_wait_s
from worker.kv_event_log import KVEventLog
from worker.liveness import DEFAULT_STALL_FLOOR_S, Liveness, Verdict

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.001
# Iterations in a row that raise before the worker gives up on the requests it holds: a
# step that fails every time (a request the model cannot run, a broken kernel) would
# otherwise hang each of them while the loop keeps trying.
FAILED_ITERATIONS_BEFORE_GIVING_UP = 3


class ShuttingDown(Exception):
    """The worker is shutting down: it takes no new request (nothing of this one started)."""


class OpenCalls:
    """The request calls a worker's gRPC threads are serving: each counts from its handler's
    start to the call's end, so a drain sees a request before the loop has admitted it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.open = 0

    def opened(self) -> None:
        with self._lock:
            self.open += 1

    def closed(self) -> None:
        with self._lock:
            self.open -= 1


class EngineLoop:
    name = ""  # the worker's name (role-id-incarnation), set by subclasses: the stall fault matches it

    def __init__(self, engine: LLMEngine, name: str = "engine-loop", stall_floor_s: float = DEFAULT_STALL_FLOOR_S):
        self.engine = engine
        self.liveness = Liveness(stall_floor_s)
        self._stall_file = envs.fault_stall_file()
        self._slow_factor = envs.fault_slow_factor()
        self._step_floor_s = envs.fault_step_floor_s()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_iteration = time.monotonic()  # a stalled loop stops moving this
        self.num_errors = 0  # iterations that raised (logged); the loop keeps going
        self.closing = False  # shutting down: no new request is taken
        self.address = ""  # its gRPC address, once its server is bound (worker/process.py serve)
        self.failing = 0  # iterations in a row that raised; 0 once one succeeds
        self.last_error = ""
        self._step_log = envs.step_log_enabled()
        self._last_step_end: float | None = None  # perf_counter at the end of the last step's iteration
        self._shape: dict = {}  # the step being run, as the step log writes it
        self._idle_command: Callable[[], None] | None = None
        self._probe: Future | None = None  # the probe in flight: concurrent deep checks share it
        self._probe_lock = threading.Lock()
        self.num_probes = 0  # probes the loop ran (a flood of deep checks runs few)
        self.last_step_seconds = 0.0  # the engine's own time for the last step that ran
        self.calls = OpenCalls()  # the role's request calls (Generate, Prefill) not ended yet
        # a tensor-parallel worker's slow rank, judged at each deep health check (a window each)
        self.stragglers = StragglerWatch(engine.ranks.clocks) if engine.ranks is not None else None
        # The prefix cache's events, numbered for the gateways' Stats (worker/kv_event_log.py):
        # the engine's buffer is drained into the log at the end of each iteration.
        self._kv_buffer = engine.record_kv_events()
        self.kv_events = KVEventLog()
        self.kv_events.take(KVEventBatch([], lost=True), engine.cached_block_hashes)  # what it holds already
        kv_disk_metrics.watch(engine.disk_tier_stats)  # read at each scrape (None: no disk tier)
        moe_metrics.watch(engine.routed_tokens_per_expert)  # likewise (None: a dense model)
        self._disk_tokens = 0  # the engine's disk_tier_tokens observed into PREFIX_TIER_TOKENS so far

    # -- hooks for workers ----------------------------------------------------------------

    def poll(self) -> bool:
        """Called every iteration on the loop thread; return True if it did work."""
        return False

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """Called on the loop thread after a step is scheduled and before it runs (what it
        reserved for remote prefills is in `out.remote_prefills`)."""

    def on_step(self, result: StepResult) -> None:
        """Called on the loop thread with what each step did."""

    def fail_all(self, reason: str) -> None:
        """Called on the loop thread when iterations keep failing: end every request this
        worker holds with an error (each must reach its caller, none may hang), so the
        engine is empty and new requests can run."""

    # Called after each decoder layer of a step when set (EngineLoop passes it to execute).
    between_layers: Callable[[], None] | None = None

    def step(self) -> StepResult:
        """One engine step with this worker's hooks (what each loop iteration runs)."""
        _, result = self._schedule_and_execute()
        self.on_step(result)
        return result

    def _schedule_and_execute(self) -> tuple[SchedulerOutput, StepResult]:
        out = self.engine.schedule()
        if self._step_log:
            self._shape = step_log.shape(out)
        self.on_scheduled(out)
        try:
            return out, self.engine.execute(out, self.between_layers)
        except Exception:
            if out.preempted:  # the schedule took their blocks back all the same: the worker must know
                self.on_step(StepResult([], list(out.preempted), None))
            raise

    # -- other threads --------------------------------------------------------------------

    def warm_up(self) -> float:
        """Run the engine's warm-up step (before `start`, on the caller's thread) and learn
        from it the longest step to expect; returns its duration in seconds."""
        while self._stalled():  # the injected wedge holds a starting worker too: it never gets ready
            time.sleep(0.05)
        t0 = time.perf_counter()
        tokens = self.engine.warm_up()
        seconds = self._stretch(t0, tokens)
        self.liveness.warmed_up(seconds, tokens)
        log.info("%s: warm-up step of %d tokens took %.3fs (%.0f tokens/s); stall bound %.1fs (floor %.1fs)%s",
                 self.name or "worker", tokens, seconds, tokens / seconds, self.liveness.bound_s, self.liveness.floor_s,
                 self._stretch_note())
        return seconds

    def _stretch_note(self) -> str:
        note = f"; steps stretched {self._slow_factor:g}x ({envs.FAULT_SLOW_FACTOR})" if self._slow_factor > 1 else ""
        if self._step_floor_s > 0:
            note += f"; steps last at least {self._step_floor_s:g}s ({envs.FAULT_STEP_FLOOR_S})"
        return note

    def start(self) -> None:
        self._thread.start()

    def loop_wait_s(self) -> float:
        """How long another thread may wait for the loop to get to its command (one step at
        most): the stall bound, past which the loop is wedged anyway, or a floor if longer."""
        return loop_wait_s(self.liveness.bound_s)

    def health(self, timeout_s: float) -> Verdict:
        """Deep health, from a gRPC thread: a worker with work is judged by its last completed
        step; an idle one runs a real forward pass through the loop (waiting at most
        `timeout_s`, the caller's deadline, for it)."""
        e = self.engine
        if not self._thread.is_alive():
            return Verdict(False, False, self.liveness.age_s(), self.liveness.bound_s, self.liveness.longest_step_s,
                           0, "the engine loop thread is not running")
        if self.failing:
            verdict = Verdict(False, e.has_unfinished(), self.liveness.age_s(), self.liveness.bound_s,
                              self.liveness.longest_step_s, e.stats().queued,
                              f"engine steps are failing ({self.failing} in a row): {self.last_error}")
            log.warning("%s: deep health: %s", self.name, verdict.detail)
            return verdict
        if e.has_unfinished():
            verdict = self.liveness.judge_busy(e.stats().queued)
        else:
            try:
                self._shared_probe().result(timeout=max(0.05, timeout_s))
                self.liveness.probed()
                verdict = self.liveness.judge_idle(True, 0.0)
            except TimeoutError:
                verdict = self.liveness.judge_idle(False, time.monotonic() - self.last_iteration)
            except Exception as exc:  # the model itself failed: not a healthy worker
                verdict = self.liveness.judge_idle(False, 0.0, error=f"{type(exc).__name__}: {exc}")
        if not verdict.ok:
            log.warning("%s: deep health: %s", self.name, verdict.detail)
        if self.stragglers is not None:  # a slow rank is slow, not wedged: named, not failed
            verdict = dataclasses.replace(verdict, straggler=self.stragglers.look())
        return verdict

    def _shared_probe(self) -> Future:
        """The probe in flight, or a new one: checks that arrive together share one forward pass."""
        with self._probe_lock:
            if self._probe is None or self._probe.done():
                future: Future = Future()

                def run() -> None:
                    self.num_probes += 1
                    try:
                        future.set_result(self.engine.probe())
                    except BaseException as e:  # handed to every waiting caller
                        future.set_exception(e)

                self._probe = future
                self.submit(run)
            return self._probe

    def holds_work(self) -> bool:
        """Requests still held: what must end before the loop may stop (any thread)."""
        return self.engine.has_unfinished()

    def holdings(self) -> Holdings:
        """Everything this worker holds (on the loop thread): what a drain waits for."""
        return Holdings(self.calls.open, self.engine.num_unfinished(), held_blocks=self.engine.num_held())

    def hand_off(self) -> None:
        """Called on the loop thread by a drain that hands off: end every request held so
        that its caller continues it elsewhere (a decode worker's); by default, nothing."""

    def drain(self, hand_off: bool = False) -> Holdings:
        """Take no new request from now on (and with `hand_off`, end those held for their
        callers to continue elsewhere), and say what is still held (any thread: the answer
        comes from the loop, between two steps). Raises TimeoutError when the loop does not
        get to it within `loop_wait_s` (wedged: its health says so too)."""
        if not self.closing:
            log.info("%s: draining: no new request is taken", self.name)
        self.closing = True

        def answer() -> Holdings:
            if hand_off:
                self.hand_off()
            return self.holdings()

        return self.call(answer, timeout=self.loop_wait_s())

    def shutdown(self) -> None:
        """SIGTERM: take no new request, end every one still held (a decode worker's streams
        with an error their gateway retries elsewhere, a prefill worker's pushes cancelled
        and answered once nothing is in flight), then stop the loop. Only after this may the
        gRPC server stop: a caller that finds the address refusing connections then knows
        nothing of its requests is being written. A drained worker holds nothing by now
        (deploy/drain.py); every wait here is the loop's own bound (`loop_wait_s`)."""
        self.closing = True
        if self.holds_work():
            log.info("%s: requests still held at SIGTERM: ending them", self.name)
            self.submit(lambda: self.fail_all("worker shutting down"))
            deadline = time.monotonic() + 2 * self.loop_wait_s()  # the command runs, then what it started ends
            while self.holds_work() and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.holds_work():
            log.warning("%s: requests still held %.0fs after SIGTERM", self.name, 2 * self.loop_wait_s())
        self.stop(self.loop_wait_s())

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before its next step."""
        self._commands.put(fn)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the loop thread and return its result (or raise what it raised).

        Raises TimeoutError if the loop does not start it within `timeout` seconds (it then
        never runs). One the loop has started by then is waited for, to its result: the
        caller must never report "not done" for something that was (an admitted request).
        """
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller's thread
                    future.set_exception(e)

        self.submit(run)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.cancel():  # not started: it never will
                raise
        return future.result()  # running (commands are short): its outcome, whatever it is

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            while self._stalled():
                time.sleep(0.01)  # injected fault: a wedged loop behind a live gRPC server
            self.last_iteration = time.monotonic()
            try:
                busy = self._iterate()
                self.failing = 0
            except Exception as exc:  # keep serving: a dead loop behind a live server hangs every request
                self.num_errors += 1
                self.failing += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("engine loop iteration failed (%d in a row)", self.failing)
                if self.failing >= FAILED_ITERATIONS_BEFORE_GIVING_UP:
                    self._give_up(self.last_error)
                busy = True
            if not busy:
                self._last_step_end = None  # the next step's gap is not the loop's work
                try:  # sleep until a command arrives; it runs at the top of the next iteration
                    self._idle_command = self._commands.get(timeout=_IDLE_WAIT_S)
                except queue.Empty:
                    pass

    def _give_up(self, reason: str) -> None:
        log.error("%s: %d iterations in a row failed (%s): failing every request it holds",
                  self.name or "worker", self.failing, reason)
        try:
            self.fail_all(f"engine steps failed: {reason}")
        except Exception:
            log.exception("failing the requests failed")

    def _stretch(self, t0: float, tokens: int) -> float:
        """The injected slow host (envs.fault_slow_factor, envs.fault_step_floor_s): sleep
        until the work begun at `t0` has taken `factor` times as long, and a step that ran
        `tokens` > 0 at least the floor. Returns the (stretched) duration."""
        took = time.perf_counter() - t0
        target = took * self._slow_factor
        if tokens > 0:
            target = max(target, self._step_floor_s)
        if target > took:
            time.sleep(target - took)
            return time.perf_counter() - t0
        return took

    def reported(self, stats: StepStats | None) -> StepStats | None:
        """The engine's own step time as the injected slow host makes it (envs.fault_slow_factor,
        envs.fault_step_floor_s), for what the worker reports (its metrics, Stats): the online
        planner corrects its costs from these, so a stretched host must look stretched there too."""
        if stats is None or (self._slow_factor <= 1 and self._step_floor_s <= 0):
            return stats
        seconds = stats.seconds * self._slow_factor
        if stats.num_tokens > 0:
            seconds = max(seconds, self._step_floor_s)
        return dataclasses.replace(stats, seconds=seconds)

    def _stalled(self) -> bool:
        """The injected wedge (envs.fault_stall_file): its file exists and is empty or names us
        (`decode-0-<incarnation>`, or `decode-0`: any incarnation of that worker)."""
        if self._stall_file is None or self._stop.is_set():
            return False
        try:
            names = self._stall_file.read_text().split()
        except OSError:  # no file (the usual case): one failed open per iteration
            return False
        return not names or self.name in names or self.name.rsplit("-", 1)[0] in names

    def _iterate(self) -> bool:
        busy = self._drain()
        busy |= self.poll()
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            out, result = self._schedule_and_execute()
            self.liveness.stepped(self._stretch(t0, out.num_tokens), out.num_tokens)
            stats = self.reported(result.stats)
            if stats is not None:
                self.last_step_seconds = stats.seconds
            metrics.observe_step(out, stats)
            if self.engine.disk_tier_tokens != self._disk_tokens:  # the schedule brought blocks in from disk
                metrics.PREFIX_TIER_TOKENS.labels("disk").inc(self.engine.disk_tier_tokens - self._disk_tokens)
                self._disk_tokens = self.engine.disk_tier_tokens
            busy |= result.ran or bool(result.outputs)
            self.on_step(result)
            if self._step_log and result.stats is not None:
                ended = time.perf_counter()
                gap = None if self._last_step_end is None else t0 - self._last_step_end
                step_log.record(trace.process(), self._shape, stats.seconds, t0, ended, gap)
                self._last_step_end = ended
        if self._kv_buffer.pending:
            self.kv_events.take(self._kv_buffer.drain(), self.engine.cached_block_hashes)
        return busy

    def _drain(self) -> bool:
        ran = False
        while True:
            if self._idle_command is not None:  # taken while idle: it came first
                fn, self._idle_command = self._idle_command, None
            else:
                try:
                    fn = self._commands.get_nowait()
                except queue.Empty:
                    return ran
            ran = True
            try:
                fn()
            except Exception:  # a bad command must not take the loop down
                log.exception("engine loop command failed")
