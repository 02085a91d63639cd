"""What a worker holds, and how long stopping it may take.

A worker leaves a deployment only once it confirms it holds nothing (`Holdings.empty`):
no call open, no request served, no remote prefill in flight, no blocks waiting for a
confirmation. The deploy controller asks for this with the `Drain` RPC (deploy/drain.py),
which also stops the worker taking new requests, so the answer stays true.

`shutdown_bound_s` is how long a worker's SIGTERM shutdown may take (worker/loop.py
`EngineLoop.shutdown`, worker/process.py `serve`), derived from its stall bound, itself
from its measured step times: what its host waits before SIGKILL.
"""

from __future__ import annotations

from dataclasses import dataclass

# The floor of a wait for the engine loop to run a command: the loop takes commands
# between steps, so a healthy loop runs one within a step; the stall bound (10x the
# longest step measured) or this, whichever is longer.
LOOP_WAIT_FLOOR_S = 10.0
# A process's own exit after its loop and server stopped: NIXL agent and channels closed.
EXIT_MARGIN_S = 5.0


@dataclass(frozen=True)
class Holdings:
    """What one worker holds now (one consistent view, taken on its engine loop)."""

    open_calls: int  # Generate / Prefill calls not ended yet
    requests: int  # a decode worker's streams, a prefill worker's prefills (until their pushes end)
    awaiting_kv: int = 0  # decode: remote prefills in flight
    held_blocks: int = 0  # requests whose blocks wait for a confirmation (abort, push end)

    @property
    def empty(self) -> bool:
        return not (self.open_calls or self.requests or self.awaiting_kv or self.held_blocks)

    def describe(self) -> str:
        if self.empty:
            return "holds nothing"
        parts = [(self.open_calls, "open calls"), (self.requests, "requests"), (self.awaiting_kv, "awaiting KV"),
                 (self.held_blocks, "held for a confirmation")]
        return ", ".join(f"{n} {what}" for n, what in parts if n)


def loop_wait_s(stall_bound_s: float) -> float:
    """How long another thread may wait for the loop to get to its command (one step at
    most): the stall bound, past which the loop is wedged anyway, or the floor if longer."""
    return max(LOOP_WAIT_FLOOR_S, stall_bound_s)


def shutdown_bound_s(stall_bound_s: float) -> float:
    """The longest a SIGTERM shutdown takes: the loop runs the command that ends what is
    held (one loop wait), those ends complete (a push cancelled, an abort answered: one
    more), the loop stops (one more), the gRPC server lets its last calls end (one more),
    and the process exits."""
    return 4 * loop_wait_s(stall_bound_s) + EXIT_MARGIN_S
