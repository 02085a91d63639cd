"""Rank 0's side of a tensor-parallel engine: it starts the other ranks (one process
each), joins the process group with them, sends each step's plan, and stops them.

`LeaderRunner` is the runner rank 0's engine calls: the plan goes out before rank 0's own
forward pass, so every rank enters the step's collectives in the same order. The scheduler,
the KV manager and sampling stay on rank 0; every rank's pool has the same block ids.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

import kernels.memory
from engine.config import EngineConfig
from engine.kv_cache import KVCache, pool_shape
from engine.model_runner import ModelRunner, PreparedStep, RunnerOutput
from engine.parallel.follower import follower_main, join_group
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.rank_clock import RankClocks, injected_stretch
from engine.parallel.step_plan import StepPlan
from engine.scheduler import SchedulerOutput
from engine.step_buffers import StepLimits

READY_S = 600  # bound on a follower's start (spawn, imports, its weights)
STOP_S = 30
# How long a failed step waits for a follower's own death before naming the step's error
# instead: a killed follower's exit follows its broken connections at once.
DEATH_GRACE_S = 2.0

log = logging.getLogger(__name__)


class RankGroup:
    """The follower processes of one tensor-parallel engine, and rank 0's membership.

    A watcher thread waits on the followers' exits: one that ends while the group is open
    is recorded in `lost` ("rank R is gone (pid P, exit code C)") and handed to `on_lost`,
    if set, at once, idle or not (a worker process ends itself there, so the group is
    replaced as a whole: worker/process.py). Without `on_lost`, the next step fails with
    the rank named."""

    def __init__(self, config: EngineConfig, num_blocks: int, limits: StepLimits):
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group: one tensor-parallel engine "
                               "per process")
        size = config.tensor_parallel_size
        device = torch.device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise RuntimeError(f"tensor_parallel_size={size} from {config.device} on CUDA needs a device per rank "
                               f"(cuda:{device.index or 0}..cuda:{(device.index or 0) + size - 1}); "
                               f"{torch.cuda.device_count()} visible")
        self.clocks = RankClocks(size)  # every rank's step and collective times (engine/parallel/rank_clock.py)
        self.layouts = [TensorParallelLayout.of(config.model, size, rank) for rank in range(size)]
        self._pipes, self._procs = [], []
        self._closing = threading.Event()
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self._shm = None
        # from here on, whatever fails stops what was started and removes both folders
        self._closer = weakref.finalize(self, _stop, self._pipes, self._procs, self._dir, self._closing)
        try:
            self._start(config, num_blocks, limits)
        except BaseException:
            self.close()
            raise
        finally:
            if self._shm:  # every rank mapped its pool (or failed): the memory lives while they are mapped
                shutil.rmtree(self._shm, ignore_errors=True)

    def _start(self, config: EngineConfig, num_blocks: int, limits: StepLimits) -> None:
        size = config.tensor_parallel_size
        rendezvous = str(Path(self._dir) / "rendezvous")
        # With share_rank_pools (CPU), every follower's KV pool is memory shared with this
        # process, so the group's transfer agent (rank 0's) can register every rank's pool:
        # KV moves between groups of any degrees without the followers taking part
        # (transfer/ranks.py).
        # A latent model's ranks hold the same KV (the latent is replicated): with shared
        # pools, the group keeps one, every rank's (rank 0's too), which each rank writes
        # with the same bytes. A push then moves a block once per group, not once per rank.
        self.pools: list[torch.Tensor] = []  # ranks 1..'s pools, as mapped here (CPU only)
        self.group_pool: torch.Tensor | None = None  # the one pool of a latent model's group
        self._shm = _shared_folder() if config.share_rank_pools and torch.device(config.device).type == "cpu" \
            else None
        paths = [None] * size
        if self._shm and config.model.mla is not None:
            paths[1:] = [str(Path(self._shm) / "group.kv")] * (size - 1)
            shape = pool_shape(self.layouts[0].local_config(config.model), num_blocks, config.cache.block_size)
            self.group_pool = kernels.memory.shared_zeros(paths[1], shape, config.dtype)
        for rank in range(1, size if self._shm and self.group_pool is None else 1):
            paths[rank] = str(Path(self._shm) / f"rank-{rank}.kv")
            shape = pool_shape(self.layouts[rank].local_config(config.model), num_blocks, config.cache.block_size)
            self.pools.append(kernels.memory.shared_zeros(paths[rank], shape, config.dtype))
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=follower_main, daemon=True, name=f"tp-rank-{rank}",
                               args=(config, rank, rendezvous, num_blocks, limits, torch.get_num_threads(), theirs,
                                     self.clocks, paths[rank]))
            proc.start()
            theirs.close()
            self._pipes.append(ours)
            self._procs.append(proc)
        deadline = time.monotonic() + READY_S
        self._expect("started", deadline)  # each rank imported and running: else it says why here
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()
        self._join(rendezvous, size, config.device, deadline)
        self._expect("ready", deadline)

    def _expect(self, word: str, deadline: float) -> None:
        """Every follower's `word` on its pipe, or an error naming the first that ended
        instead (or was silent past `deadline`): never a wait on a rank that is gone."""
        waiting = {pipe: rank for rank, pipe in enumerate(self._pipes, start=1)}
        ended = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        while waiting:
            left = deadline - time.monotonic()
            ready = wait([*waiting, *ended], timeout=max(0.0, left))
            if not ready:
                rank = min(waiting.values())
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within {READY_S} s")
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        got = obj.recv()
                    except EOFError:
                        got = None
                    if got != word:
                        raise self._lost_at_start(rank, word)
            for sentinel, rank in ended.items():  # after the pipes: a rank that said its word, then ended, is seen
                if sentinel in ready and any(r == rank for r in waiting.values()):
                    raise self._lost_at_start(rank, word)

    def _join(self, rendezvous: str, size: int, device: str, deadline: float) -> None:
        """Rank 0's place in the process group, given up as soon as a follower ends (the
        group's rendezvous would otherwise wait for it until its own timeout)."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                join_group(rendezvous, size, 0, device)
            except BaseException as e:  # handed to the caller
                failure.append(e)

        joining = threading.Thread(target=join, name="tp-join", daemon=True)
        joining.start()
        ended = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        while joining.is_alive():
            gone = wait(list(ended), timeout=0.05)
            if gone:
                raise self._lost_at_start(ended[gone[0]], "ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not form a group within {READY_S} s")
        if failure:
            raise failure[0]

    def _lost_at_start(self, rank: int, word: str) -> RuntimeError:
        proc = self._procs[rank - 1]
        proc.join(1.0)
        why = f"tensor-parallel rank {rank} (pid {proc.pid}) ended with exit code {proc.exitcode} before it was {word}"
        main = sys.modules.get("__main__")
        if word == "started" and getattr(main, "__file__", None):
            why += (f". Each rank is a new process that imports the main module ({main.__file__}) again first: "
                    "a script that builds an engine with tensor_parallel_size > 1 at module level must build it "
                    "under `if __name__ == \"__main__\":`, or every rank tries to start the group again and fails "
                    "(its error is above)")
        else:
            why += " (its error is above)"
        return RuntimeError(why)

    @property
    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [proc.pid for proc in self._procs]

    def send(self, plan: StepPlan) -> None:
        if self.lost is not None:
            raise RuntimeError(f"tensor-parallel {self.lost}: the group cannot step")
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send(plan)
            except (BrokenPipeError, ConnectionResetError, EOFError) as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone "
                                   f"(exit code {self._procs[rank - 1].exitcode})") from e

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        ended = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ended[0]]
        proc = self._procs[rank - 1]
        self.lost = f"rank {rank} is gone (pid {proc.pid}, exit code {_exit_code(proc.pid)})"
        log.error("tensor-parallel %s", self.lost)
        shutil.rmtree(self._dir, ignore_errors=True)  # the group is over: nothing reads its rendezvous
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def fail(self, reason: str) -> None:
        """A step failed on rank 0 after its plan went out: the followers may be inside that
        step's collectives, and rank 0's next step would pair with them one step behind. The
        group is over: the followers are killed, `lost` says why, and `on_lost` hears it (a
        worker ends itself there and is replaced as a whole); without it every later step
        fails with the reason."""
        # A follower killed mid-step breaks that step's collectives on rank 0 before the watcher
        # hears of its death: a follower that ends by itself within a moment is the cause, named.
        ended = wait([proc.sentinel for proc in self._procs], timeout=DEATH_GRACE_S)
        if self.lost is None and ended:
            rank, proc = next((r, p) for r, p in enumerate(self._procs, start=1) if p.sentinel == ended[0])
            self.lost = f"rank {rank} is gone (pid {proc.pid}, exit code {_exit_code(proc.pid)})"
        if self.lost is None:
            self.lost = reason
        log.error("tensor-parallel %s: ending the group", self.lost)
        self._closing.set()  # the followers ending from here on were ended, not lost
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def close(self) -> None:
        """Stop the followers (bounded; killed past it) and leave the process group."""
        self._closer()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_code(pid: int) -> int | None:
    """An ended child's exit code (negative: the signal that killed it), read without reaping
    it: whoever joins the process (close, a caller) still gets its code."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return None
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def _shared_folder() -> str:
    """A private folder in memory (/dev/shm where there is one) for the followers' pools."""
    return tempfile.mkdtemp(prefix="pdserve-tp-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def _stop(pipes, procs, folder: str, closing: threading.Event) -> None:
    closing.set()  # followers ending from here on are stopped, not lost
    for pipe in pipes:
        try:
            pipe.send(None)
        except OSError:
            pass
    for proc in procs:
        proc.join(STOP_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_S)
    for pipe in pipes:
        pipe.close()
    shutil.rmtree(folder, ignore_errors=True)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: sends the step's plan to the other ranks, then runs it like any runner."""

    def __init__(self, model, kv_cache: KVCache, device: str, limits: StepLimits, ranks: RankGroup):
        super().__init__(model, kv_cache, device, limits)
        self.ranks = ranks
        self._stretch = injected_stretch(0)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.ranks.send(StepPlan.of(out))
        try:
            return super().execute(out)
        except Exception as e:  # after the plan went out: the ranks are no longer in step
            self.ranks.fail(f"rank 0's step failed ({type(e).__name__}: {e})")
            raise

    def forward(self, step: PreparedStep) -> torch.Tensor | None:
        return self.ranks.clocks.timed(0, self.model.collectives, partial(ModelRunner.forward, self, step),
                                       self._stretch)
