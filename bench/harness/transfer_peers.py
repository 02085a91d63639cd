"""NIXL peers for the transfer tests (tests/transfer/test_transfer.py): one real NIXL worker
per OS process, each holding one agent with both a pusher and a receiver.

`worker_main` runs in a process started with the "spawn" context. It creates a
TransferAgent over a small bf16 pool (zeros, or each block filled with `block_pattern`),
publishes `TransferInfo.to_bytes()` and then loops: poll the receiver and the pusher
(which also drives NIXL wire-up), then answer at most one command from the Pipe. Every
reply is `("ok", value)` or `("error", exception class name, message)`, so a failure in
the child becomes an assertion in the test instead of a hang.

`PeerProcess` is the parent's handle: every wait on it is bounded.

bandwidth_peers.py beside this runs NIXL peers too, for `python -m bench.transfer`, and
shares no code with this: its two sides are built for timing (large random pools, only
a sender or only a receiver, digests instead of whole-pool reads, reference copies),
these for checking behaviour (small patterned pools, every event recorded with its
time and, for a complete request, its blocks' bytes, the NIXL calls traced).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, NamedTuple

import numpy as np

MODEL = "tiny-llama-test"
LAYOUT = dict(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
BLOCK_BYTES = 2 * 4 * 16 * 2 * 64 * 2  # 2 (K, V) * layers * block_size * kv heads * head_dim * bf16

_CTX = mp.get_context("spawn")


def block_pattern(block_id: int, salt: int, block_bytes: int = BLOCK_BYTES) -> bytes:
    """Recognisable, never-zero bytes for one sender block: distinct per (block id < 255, salt)."""
    pos = np.arange(block_bytes, dtype=np.int64)
    return ((pos * 31 + block_id * 97 + salt * 61) % 255 + 1).astype(np.uint8).tobytes()


class Recorded(NamedTuple):
    """A PushEvent / ReceiveEvent as the child saw it; `data` is a COMPLETE request's blocks
    copied from the pool in the same loop iteration that received the notification."""

    t: float  # time.monotonic() in the child (CLOCK_MONOTONIC is system-wide)
    event: Any
    data: bytes | None = None


class _TracingNixl:
    """Passes every call to the real nixl_agent; logs posts and the states seen per handle."""

    def __init__(self, nixl, log: list):
        self._nixl = nixl
        self._log = log
        self._serial: dict[int, int] = {}  # id(handle) -> serial number, in the order handles were made
        self._made = 0

    def __getattr__(self, name):
        return getattr(self._nixl, name)

    def make_prepped_xfer(self, *args, **kwargs):
        handle = self._nixl.make_prepped_xfer(*args, **kwargs)
        self._serial[id(handle)] = self._made
        self._made += 1
        notif = args[5] if len(args) > 5 else kwargs.get("notif_msg", b"")
        self._log.append(("make", self._serial[id(handle)], bytes(notif)))
        return handle

    def transfer(self, handle, *args):
        self._log.append(("post", self._serial[id(handle)], None))
        return self._nixl.transfer(handle, *args)

    def check_xfer_state(self, handle):
        state = self._nixl.check_xfer_state(handle)
        self._log.append(("state", self._serial[id(handle)], state))
        return state


def worker_main(conn, name: str, num_blocks: int, salt: int | None, layout_overrides: dict, model: str) -> None:
    """Child process: a worker with one agent, one KVReceiver and one KVPusher."""
    import torch

    torch.set_num_threads(1)
    from prometheus_client import REGISTRY

    from transfer.agent import TransferAgent
    from transfer.handshake import TransferInfo
    from transfer.layout import KVLayout
    from transfer.push import KVPusher
    from transfer.receive import KVReceiver, ReceiveStatus

    layout = KVLayout(num_blocks=num_blocks, **{**LAYOUT, **layout_overrides})
    pool = torch.zeros(layout.pool_bytes // 2, dtype=torch.bfloat16)  # [num_blocks * block_bytes / 2]
    blocks = pool.view(torch.uint8).view(num_blocks, layout.block_bytes)  # [num_blocks, block_bytes]
    if salt is not None:
        for b in range(num_blocks):
            blocks[b] = torch.frombuffer(bytearray(block_pattern(b, salt, layout.block_bytes)), dtype=torch.uint8)
    agent = TransferAgent(name, pool, layout, model)
    trace: list = []
    agent.nixl = _TracingNixl(agent.nixl, trace)
    receiver = KVReceiver(agent)
    pusher = KVPusher(agent)
    snapshot_blocks: dict[str, list[int]] = {}
    events: list[Recorded] = []

    def ops(steps):
        for step in steps:
            op, *args = step
            {"start": pusher.start, "push": pusher.push, "abort": pusher.abort}[op](*args)

    def expect(request_id, remote_blocks, sender=None, timeout_s=None):
        snapshot_blocks[request_id] = list(remote_blocks)
        receiver.expect(request_id, sender, timeout_s)

    def drain():
        out = list(events)
        events.clear()
        return out

    commands = {
        "add_peer": lambda data: agent.add_peer(TransferInfo.from_bytes(data)),
        "peers": lambda: sorted(agent.peers),
        "ops": ops,
        "expect": expect,
        "events": drain,
        "num_active": lambda: pusher.num_active,
        "read": lambda: blocks.numpy().tobytes(),
        "zero": lambda: blocks.zero_().sum().item(),  # 0 once cleared
        "trace": lambda: list(trace),
        "metric": lambda metric, labels: REGISTRY.get_sample_value(metric, labels),
    }
    conn.send(("ok", agent.info().to_bytes()))
    while True:
        for ev in pusher.poll():
            events.append(Recorded(time.monotonic(), ev))
        for ev in receiver.poll():
            data = None
            if ev.status is ReceiveStatus.COMPLETE and ev.request_id in snapshot_blocks:
                data = blocks[snapshot_blocks[ev.request_id]].numpy().tobytes()
            events.append(Recorded(time.monotonic(), ev, data))
        if not conn.poll(0.001):
            continue
        cmd, args = conn.recv()
        if cmd == "close":
            break
        try:
            result = commands[cmd](*args)
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e)))
    agent.close()
    conn.send(("ok", None))


class ChildError(AssertionError):
    """A command raised in the child; `kind` is the exception's class name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class PeerProcess:
    """Parent-side handle of one worker process; every wait is bounded."""

    def __init__(self, name: str, num_blocks: int = 64, salt: int | None = None,
                 layout_overrides: dict | None = None, model: str = MODEL):
        self.name = name
        self.salt = salt
        self.conn, child_conn = _CTX.Pipe()
        self.proc = _CTX.Process(target=worker_main, name=name, daemon=True,
                                 args=(child_conn, name, num_blocks, salt, layout_overrides or {}, model))
        self.proc.start()
        child_conn.close()
        self.info_bytes: bytes | None = None

    def wait_ready(self, timeout_s: float = 60.0) -> bytes:
        self.info_bytes = self._reply(timeout_s)
        return self.info_bytes

    def call(self, cmd: str, *args, timeout_s: float = 10.0):
        self.conn.send((cmd, args))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no reply within {timeout_s} s (alive: {self.proc.is_alive()})")
        status, *rest = self.conn.recv()
        if status == "error":
            raise ChildError(*rest)
        return rest[0]

    def wait_events(self, done, timeout_s: float = 10.0) -> list[Recorded]:
        """Collect events until `done(events)` is true; TimeoutError with what came otherwise."""
        got: list[Recorded] = []
        deadline = time.monotonic() + timeout_s
        while True:
            got += self.call("events")
            if done(got):
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: events so far {[r.event for r in got]}")
            time.sleep(0.01)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Clean exit: the child closes its agent; it must report ok and exit with status 0."""
        self.call("close", timeout_s=timeout_s)
        self.proc.join(timeout_s)
        assert self.proc.exitcode == 0, f"{self.name} exited with {self.proc.exitcode}"

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def close(self, timeout_s: float = 10.0) -> None:
        """Clean shutdown (agent.close() in the child); kill it if that does not finish."""
        try:
            if self.proc.is_alive():
                self.call("close", timeout_s=timeout_s)
            self.proc.join(timeout_s)
        except (OSError, EOFError, TimeoutError, ChildError):
            pass
        finally:
            self.kill()
            self.conn.close()
