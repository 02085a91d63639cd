"""python -m bench.harness.fixed_time_worker --step-s S [--step-times FILE] [--profile FILE] <python -m decode's flags>

A decode worker whose every engine step lasts S seconds and runs no model
(bench/harness/fixed_time_step.py): the engine, its loop, its gRPC services and their
threads are the real decode worker's (worker/process.py `build_engine` and `serve`,
decode/role.py `DECODE`), only the forward pass and sampling are replaced. For
bench/stream_path.py, which measures the way tokens go out of a decode worker at GPU step
rates; never a serving worker. The warm-up step runs through the stand-in too (one step of
S seconds), so the stall bound is derived from S.

`--step-times FILE` writes, when the worker stops, one line per step: the times it began
and ended (time.monotonic(), the host's one monotonic clock) and the tokens it sampled.
`--profile FILE` writes cProfile statistics of every Python thread of the process (the
engine loop, the gRPC threads) to FILE when it stops, timed in each thread's own CPU time
(waits for the GIL, a lock or a core count nothing), to see where its CPU goes.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import threading
import time

from bench.harness.fixed_time_step import FixedTimeStep, visible_token_ids
from decode.role import DECODE
from worker.process import build_engine, serve


def arguments() -> argparse.ArgumentParser:
    parser = DECODE.arguments()
    parser.prog = "python -m bench.harness.fixed_time_worker"
    parser.add_argument("--step-s", type=float, required=True, help="seconds every engine step lasts")
    parser.add_argument("--step-times", default=None, help="write each step's start, end and tokens here at the end")
    parser.add_argument("--profile", default=None, help="write every thread's cProfile statistics here at the end")
    return parser


class ThreadProfiles:
    """One cProfile profiler per Python thread started from now on (cProfile sees only the
    thread that enables it), and the main thread's; merged into one file at the end."""

    def __init__(self):
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        threading.setprofile(self._start)  # each new thread's first event enables its own profiler
        self._start()

    def _start(self, *_) -> None:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(profile)
        profile.enable()  # replaces this hook in this thread

    def dump(self, path: str) -> None:
        """Every thread's calls that returned (not those still running: a thread's profiler
        cannot be stopped from another thread without timing its open calls on this one's
        clock), merged."""
        threading.setprofile(None)
        with self._lock:
            snapshots = [_Snapshot(profile) for profile in self._profiles]
        stats = pstats.Stats(snapshots[0])
        for snapshot in snapshots[1:]:
            if snapshot.stats:
                stats.add(snapshot)
        stats.dump_stats(path)


class _Snapshot:
    """A profiler's statistics as they are now, for pstats, leaving the profiler running."""

    def __init__(self, profile: cProfile.Profile):
        profile.snapshot_stats()
        self.stats = profile.stats

    def create_stats(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profiles = ThreadProfiles() if args.profile else None
    engine, model = build_engine(args)
    cfg = engine.config.model
    tokens = visible_token_ids(engine.config.model_path, cfg.vocab_size, cfg.eos_token_ids)
    step = FixedTimeStep(args.step_s, tokens)
    engine.stand_in_forward(step)
    logging.getLogger(__name__).info("every step lasts %gs (a stand-in, no model); %d token ids in the cycle",
                                     args.step_s, len(tokens))
    serving = DECODE.build(args, engine, model)
    serve(serving.worker, serving.add_servicers, args.host, args.port)
    if args.step_times:
        with open(args.step_times, "w") as f:
            f.writelines(f"{began:.6f} {ended:.6f} {sampled}\n" for began, ended, sampled in step.steps)
    if profiles is not None:
        profiles.dump(args.profile)
        print(f"profile written to {args.profile}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
