"""Every engine step of a worker as one log line, when PDSERVE_STEP_LOG is on.

A line is the logger `pdserve.step` at INFO with one JSON object as its message:

    {"t":1764743400.1234,"proc":"decode d0","decodes":[300,412],"chunks":[[0,256]],"sampled":3,
     "engine_s":0.031,"busy_s":0.034,"gap_s":0.002}

`decodes` are the context lengths of the step's decodes and `chunks` its prefill chunks
(start, new tokens), the shape deploy/planner/sim_worker.StepShape prices; `sampled` the rows
through the LM head. `engine_s` is the engine's own time for the step (StepStats.seconds),
`busy_s` the iteration's schedule + execute + output handling, `gap_s` the time since the
previous step's iteration ended, when the loop was busy in between (commands, transfers,
streaming; null after an idle wait). `pdserve tune --steps` (deploy/planner/step_fit.py) reads
these from a deployment's logs and fits how much slower its steps ran than the profile
says, per role, and what each loop iteration adds.
"""

from __future__ import annotations

import json
import logging
import time

from engine.scheduler import SchedulerOutput

LOGGER_NAME = "pdserve.step"
_log = logging.getLogger(LOGGER_NAME)


def shape(out: SchedulerOutput) -> dict:
    """A scheduled step's shape, read before it runs (whether a chunk samples changes after)."""
    chunks = out.chunks
    return {"decodes": [c.context_len for c in chunks if c.num_new == 1],
            "chunks": [[c.start, c.num_new] for c in chunks if c.num_new > 1],
            "sampled": sum(1 for c in chunks if c.sample)}


def record(process: str, step_shape: dict, engine_s: float, started: float, ended: float,
           gap_s: float | None) -> None:
    """Log one step: `started` / `ended` are the iteration's perf_counter readings."""
    line = {"t": round(time.time() - (time.perf_counter() - started), 6), "proc": process, **step_shape,
            "engine_s": round(engine_s, 6), "busy_s": round(ended - started, 6),
            "gap_s": None if gap_s is None else round(gap_s, 6)}
    _log.info("%s", json.dumps(line, separators=(",", ":")))
