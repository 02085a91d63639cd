"""A cache of compiled things in front of a small, fair compile queue: what structured
output's grammars need so that no caller can stall the others.

    compiler = CachedCompiler(build, budget_s, max_waiters, cache_size)
    value = compiler.get(key, source, wait_s)   # cached, or compiled once for all who ask

- **One compile at a time**, on a thread of its own: compiling never takes more than one
  core from the engine loop, and never runs on it.
- **Each key once**: callers asking for a key already queued or compiling wait for that
  compile; its result (or its error) is cached, least recently used dropped.
- **Sources take turns**: the next compile comes from the next source (a tenant's name)
  in turn, so a source with many queued keys delays only itself.
- **Bounded waiting**: at most `max_waiters` callers wait (counting `others_waiting`: a
  queue elsewhere that the same threads serve), and one source has at most half that many
  distinct keys queued or compiling; past that a caller is refused with Busy at once.
- **A budget per compile, from its start**: its waiters are told Overdue once it has run
  `budget_s`, and the key is then refused from the cache, so a retry costs nothing. A
  compile cannot be interrupted: it runs on, and one more thread serves the queue meanwhile
  (at most `threads` compile at once, and never two of one source while one is overdue).
- **Nobody waiting, nothing compiled**: a queued key whose last waiter left (its `wait_s`
  passed before the compile started) is dropped from the queue.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Busy(RuntimeError):
    """Too many callers wait for compiles already (in all, or from this source), or this one
    waited `wait_s` without its compile starting: the caller should retry later."""


class Overdue(TimeoutError):
    """The compile ran past its budget."""

    def __init__(self, budget_s: float):
        super().__init__(f"did not compile within {budget_s:.3g}s")
        self.budget_s = budget_s


@dataclass(eq=False)
class _Job:
    key: Hashable
    source: str
    waiters: int = 0
    started: float | None = None  # time.monotonic() when its compile began
    done: bool = False
    value: object = None  # once done: the compiled value, or the error its callers get


class CachedCompiler(Generic[K, V]):
    """`build(key)` returns the compiled value or raises (the error is cached and raised to
    every caller of that key). Thread-safe: every caller blocks in its own thread."""

    def __init__(self, build: Callable[[K], V], budget_s: float, max_waiters: int, cache_size: int,
                 threads: int = 2, name: str = "compile") -> None:
        self._build = build
        self.budget_s = budget_s
        self.max_waiters = max_waiters
        self.max_keys_per_source = max(1, max_waiters // 2)
        self._cache_size = cache_size
        self._cache: OrderedDict[K, V | BaseException] = OrderedDict()
        self._cond = threading.Condition()
        self._jobs: dict[K, _Job] = {}  # queued or compiling
        self._queued: dict[str, deque[_Job]] = {}  # by source, in arrival order
        self._running: list[_Job] = []
        self._turns: dict[str, int] = {}  # when each source with keys in flight was last served
        self._turn = 0
        self._num_waiters = 0  # callers blocked in get()
        self._threads = threads
        self._name = name
        self._started = False
        self.num_builds = 0  # compiles begun (what deduplication saves shows here)

    @property
    def num_waiters(self) -> int:
        """Callers blocked in get() now."""
        return self._num_waiters

    def get(self, key: K, source: str = "", wait_s: float | None = None, others_waiting: int = 0) -> V:
        """The compiled value of `key`: cached, or compiled once for everyone asking for it.
        Busy if the waiting bounds are reached or `wait_s` passes before its compile starts;
        Overdue if its compile runs past the budget; whatever `build` raised for it."""
        with self._cond:
            hit = self._hit(key)
            if hit is not None:
                return hit()
            waiting = self._num_waiters
            if waiting + others_waiting >= self.max_waiters:
                raise Busy(f"the grammar compiler is busy: {waiting} compiles and {others_waiting} requests "
                           f"wait, {self.max_waiters} is the limit")
            job = self._jobs.get(key)
            if job is None:
                mine = sum(j.source == source for j in self._jobs.values())
                if mine >= self.max_keys_per_source:
                    raise Busy(f"the grammar compiler is busy: {mine} schemas of this client are being "
                               f"compiled, {self.max_keys_per_source} is the limit")
                job = self._jobs[key] = _Job(key, source)
                self._queued.setdefault(source, deque()).append(job)
                self._start_threads()
                self._cond.notify_all()
            job.waiters += 1
            self._num_waiters += 1
            try:
                self._wait(job, wait_s)
            finally:
                job.waiters -= 1
                self._num_waiters -= 1
                if not job.waiters and job.started is None and not job.done:
                    self._drop(job)  # nobody waits for it: it is never compiled
            return _give(job.value)

    def _hit(self, key: K) -> Callable[[], V] | None:
        """Under the lock: a call giving the cached value (or raising its error), or None."""
        if key not in self._cache:
            return None
        self._cache.move_to_end(key)
        value = self._cache[key]
        return lambda: _give(value)

    def _wait(self, job: _Job, wait_s: float | None) -> None:
        """Under the lock: until the job is done; Busy past `wait_s` unstarted, Overdue past the budget."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not job.done:
            now = time.monotonic()
            if job.started is None:
                if deadline is not None and now >= deadline:
                    raise Busy(f"the grammar compiler is busy: this compile waited {wait_s:.3g}s for its turn")
                self._cond.wait(None if deadline is None else deadline - now)
            else:
                end = job.started + self.budget_s
                if now >= end:
                    raise Overdue(self.budget_s)
                self._cond.wait(end - now)

    def _drop(self, job: _Job) -> None:
        queue = self._queued[job.source]
        queue.remove(job)
        if not queue:
            del self._queued[job.source]
        self._forget(job)

    def _forget(self, job: _Job) -> None:
        """Under the lock: the job is done or dropped; its source's turn is forgotten with its last job."""
        del self._jobs[job.key]
        if not any(j.source == job.source for j in self._jobs.values()):
            self._turns.pop(job.source, None)

    def _start_threads(self) -> None:
        if not self._started:
            self._started = True
            for i in range(self._threads):
                threading.Thread(target=self._serve, name=f"{self._name}-{i}", daemon=True).start()

    def _next(self) -> _Job | None:
        """Under the lock: the job to compile now, or None. One compile within its budget at a
        time; a source with a compile running (overdue) waits for it."""
        now = time.monotonic()
        if any(now < j.started + self.budget_s for j in self._running):
            return None
        busy = {j.source for j in self._running}
        ready = [s for s in self._queued if s not in busy]
        if not ready:
            return None
        source = min(ready, key=lambda s: self._turns.get(s, -1))  # served least recently (or never)
        self._turn += 1
        self._turns[source] = self._turn
        queue = self._queued[source]
        job = queue.popleft()
        if not queue:
            del self._queued[source]
        return job

    def _next_overdue_s(self) -> float | None:
        """Under the lock: seconds until a running compile is overdue (then another may start)."""
        now = time.monotonic()
        ends = [j.started + self.budget_s - now for j in self._running if now < j.started + self.budget_s]
        return min(ends) if ends else None

    def _serve(self) -> None:
        with self._cond:
            while True:
                job = self._next()
                if job is None:
                    self._cond.wait(self._next_overdue_s())
                    continue
                job.started = time.monotonic()
                self._running.append(job)
                self.num_builds += 1
                self._cond.release()
                try:
                    value: V | BaseException = self._build(job.key)
                except Exception as e:  # the key's error: every caller of it gets it
                    value = e
                finally:
                    self._cond.acquire()
                if time.monotonic() - job.started > self.budget_s:
                    value = Overdue(self.budget_s)  # refused alike however it is asked for again
                job.value = self._cache[job.key] = value
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self._running.remove(job)
                self._forget(job)
                job.done = True
                self._cond.notify_all()


def _give(value):
    """A compiled value, or its cached error raised (afresh for each caller)."""
    if isinstance(value, BaseException):
        raise value.with_traceback(None)
    return value
