"""KV push bandwidth between two pools on one device, for `python -m bench.gpu_pd`.

Two spawned processes, a sender and a receiver, each hold a block-major KV pool on the
given device (`cuda`: VRAM, registered with NIXL as VRAM segments; `cpu`: DRAM) and one
TransferAgent. The sender pushes the same scattered blocks into scattered target blocks
with KVPusher, in chunks, the last one carrying DONE, as a prefill worker does; the
receiver polls, as a decode worker's loop does. The first push (UCX wire-up included) is
reported on its own, the next ones timed (sender-side, first posted chunk to DONE); the last
is checked digest against digest after the targets were poisoned.

In the same run, in the sender process, the same number of bytes is copied once more on the
same device without NIXL: `torch.Tensor.copy_` of one contiguous buffer on a GPU (a
device-to-device copy, synchronized), libc memcpy (np.copyto) on a CPU.

Each process writes its stdout and stderr to a log: with UCX_PROTO_INFO=y (set here) UCX
prints the protocol it chose for each kind of transfer there, which says which transport
carried the bytes (cuda_ipc: device to device between processes; cma: host memory).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import statistics
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from bench.transfer import Worker
from transfer.handshake import agent_name
from transfer.layout import KVLayout

POISON = 0xA5
IDLE_POLL_S = 0.0005
_UCX_LINE = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s+(\|.*|\+.*)$")  # a line of a UCX_PROTO_INFO table


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class _Side:
    """One pool on `device` and its agent, answering the coordinator's commands."""

    def __init__(self, device: str, name: str, layout: dict, fill: int | None, seed: int = 0):
        import torch

        from transfer.agent import TransferAgent

        torch.set_num_threads(1)
        self.device = device
        self.layout = KVLayout(**layout)
        # [num_blocks, block_bytes] bytes; the agent sees it whole (its layout gives the shape)
        self.pool = torch.empty(self.layout.num_blocks, self.layout.block_bytes, dtype=torch.uint8, device=device)
        if fill is None:  # random bytes, so a missed or misplaced block cannot match by chance
            g = torch.Generator(device=device).manual_seed(seed)
            self.pool.random_(0, 256, generator=g)
        else:
            self.pool.fill_(fill)
        _sync(device)
        self.agent = TransferAgent(name, self.pool, self.layout, "bench-gpu-pd")

    def info(self) -> bytes:
        return self.agent.info().to_bytes()

    def digest(self, blocks: list[int]) -> str:
        rows = self.pool[blocks].cpu().numpy()
        return hashlib.blake2b(rows.tobytes(), digest_size=16).hexdigest()

    def close(self) -> None:
        self.agent.close()


class SenderSide(_Side):
    def __init__(self, device: str, name: str, layout: dict, seed: int):
        super().__init__(device, name, layout, None, seed)
        self.pusher = None
        self.peer = ""

    def connect(self, info: bytes, timeout_s: float) -> str:
        from transfer.handshake import TransferInfo
        from transfer.push import KVPusher

        self.peer = self.agent.add_peer(TransferInfo.from_bytes(info))
        self.pusher = KVPusher(self.agent, default_timeout_s=timeout_s)
        return self.peer

    def push(self, request_id: str, chunks: list[tuple[list[int], list[int]]], timeout_s: float) -> dict:
        """Post every chunk (the last carries DONE), poll until the push ends; sender-side seconds."""
        from transfer.push import PushStatus

        guard = time.monotonic() + timeout_s + 5.0
        t0 = time.perf_counter()
        self.pusher.start(request_id, self.peer, timeout_s)
        for i, (local, remote) in enumerate(chunks):
            self.pusher.push(request_id, local, remote, last=i == len(chunks) - 1)
        while not (events := self.pusher.poll()):
            if time.monotonic() > guard:
                raise TimeoutError(f"push {request_id}: no event within {timeout_s + 5:.0f}s")
        seconds = time.perf_counter() - t0
        ev = events[0]
        return {"ok": ev.status is PushStatus.DONE, "status": ev.status.value, "reason": ev.reason,
                "num_bytes": ev.num_bytes, "seconds": seconds}

    def copies(self, num_blocks: int, repeats: int) -> list[float]:
        """Seconds of a copy of `num_blocks` blocks' bytes on this device without NIXL, after a warm-up."""
        import torch

        src = self.pool[:num_blocks]  # one contiguous range
        if self.device.startswith("cuda"):
            dst = torch.empty_like(src)

            def copy() -> None:
                dst.copy_(src)
                torch.cuda.synchronize()
        else:
            s = src.numpy()
            d = np.ones_like(s)  # touched before timing

            def copy() -> None:
                np.copyto(d, s)
        copy()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        return times


class ReceiverSide(_Side):
    def __init__(self, device: str, name: str, layout: dict):
        from transfer.receive import KVReceiver

        super().__init__(device, name, layout, POISON)
        self.receiver = KVReceiver(self.agent)
        self.events: dict[str, object] = {}

    def expect(self, request_id: str, blocks: list[int], poison: bool, timeout_s: float) -> None:
        if poison:
            self.pool[blocks] = POISON
            _sync(self.device)
        self.receiver.expect(request_id, timeout_s=timeout_s)

    def poll(self) -> None:
        for ev in self.receiver.poll():
            self.events[ev.request_id] = ev

    def wait(self, request_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.events:
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver: nothing for {request_id} within {timeout_s:.0f}s")
            self.poll()
            time.sleep(IDLE_POLL_S)
        ev = self.events.pop(request_id)
        return {"status": ev.status.value, "num_blocks": ev.num_blocks}


def _serve(conn: Connection, make, log_path: str, passive: bool) -> None:
    """Child process: stdout/stderr to `log_path`, build the side, answer commands until "stop"."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    side = None
    try:
        while True:
            if not conn.poll(IDLE_POLL_S if passive and side is not None else 1.0):
                if passive and side is not None:
                    side.poll()  # the passive side keeps calling into NIXL, or wire-up never completes
                continue
            name, kwargs = conn.recv()
            try:
                if name == "setup":
                    side = make(**kwargs)
                    conn.send(("ok", side.info()))
                elif name == "stop":
                    if side is not None:
                        side.close()
                    conn.send(("ok", None))
                    return
                else:
                    conn.send(("ok", getattr(side, name)(**kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass


def sender_main(conn: Connection, log_path: str) -> None:
    _serve(conn, SenderSide, log_path, passive=False)


def receiver_main(conn: Connection, log_path: str) -> None:
    _serve(conn, ReceiverSide, log_path, passive=True)


class _Peer(Worker):
    def __init__(self, ctx, target, name: str, log_path: Path):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, str(log_path)), name=name, daemon=True)
        self.proc.start()
        child.close()


def ucx_writes(*logs: Path) -> list[str]:
    """What UCX chose for remote memory writes (NIXL's WRITE), from its UCX_PROTO_INFO tables
    in these logs: one line per distinct (operation, size range, protocol, transport), e.g.
    "remote memory write by ucp_put* from host memory to host: 0..inf zero-copy cma/memory"."""
    found: dict[str, None] = {}
    for log in logs:
        if not log.exists():
            continue
        what, expect_what = "", False
        for line in log.read_text(errors="replace").splitlines():
            m = _UCX_LINE.match(line)
            if not m:
                continue
            body = m.group(1).strip()
            if body.startswith("+"):
                continue
            cells = [c.strip() for c in body.strip("|").split("|")]
            if len(cells) == 1 and "cfg#" in cells[0]:
                expect_what = True
            elif len(cells) == 1 and expect_what:
                what, expect_what = cells[0], False
            elif len(cells) == 3 and "remote memory write" in what and cells[0] != "Range":
                found.setdefault(f"{what}: {cells[0]} {cells[1]} {cells[2]}", None)
    return list(found)


def measure_push(device: str, layout: KVLayout, num_blocks: int, chunks: int, repeats: int, log_dir: Path,
                 timeout_s: float = 60.0, seed: int = 0) -> dict:
    """Push `num_blocks` scattered blocks between two processes' pools on `device`; the figures."""
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # inherited by the spawned peers
    rng = np.random.default_rng(seed)
    src = rng.permutation(layout.num_blocks)[:num_blocks].tolist()
    dst = rng.permutation(layout.num_blocks)[:num_blocks].tolist()
    parts = [(s.tolist(), d.tolist()) for s, d in zip(np.array_split(src, chunks), np.array_split(dst, chunks))
             if len(s)]
    push_bytes = num_blocks * layout.block_bytes
    logs = (log_dir / "push-sender.log", log_dir / "push-receiver.log")
    ctx = mp.get_context("spawn")  # no fork: NIXL/UCX and CUDA state must not be inherited
    receiver = _Peer(ctx, receiver_main, "receiver", logs[1])
    sender = _Peer(ctx, sender_main, "sender", logs[0])
    try:
        info = receiver.call("setup", timeout_s + 120, device=device, name=agent_name("decode", "0", 1),
                             layout=asdict(layout))
        sender.call("setup", timeout_s + 120, device=device, name=agent_name("prefill", "0", 1),
                    layout=asdict(layout), seed=seed)
        sender.call("connect", info=info, timeout_s=timeout_s)

        def push(i: int, verify: bool) -> float:
            rid = f"push-{i}"
            receiver.call("expect", request_id=rid, blocks=dst, poison=verify, timeout_s=timeout_s)
            sent = sender.call("push", timeout_s + 30, request_id=rid, chunks=parts, timeout_s=timeout_s)
            if not sent["ok"] or sent["num_bytes"] != push_bytes:
                raise RuntimeError(f"{rid}: {sent['status']} ({sent['reason'] or 'no reason'}), "
                                   f"{sent['num_bytes']} of {push_bytes} bytes confirmed")
            got = receiver.call("wait", timeout_s + 30, request_id=rid, timeout_s=timeout_s)
            if got["status"] != "complete" or got["num_blocks"] != num_blocks:
                raise RuntimeError(f"{rid}: receiver saw {got['status']} with {got['num_blocks']} blocks")
            if verify and receiver.call("digest", blocks=dst) != sender.call("digest", blocks=src):
                raise RuntimeError(f"{rid}: the target blocks differ from the source blocks")
            return sent["seconds"]

        first = push(0, verify=False)
        pushes = [push(i, verify=i == repeats) for i in range(1, repeats + 1)]
        copies = sender.call("copies", num_blocks=num_blocks, repeats=repeats)
    finally:
        for peer in (sender, receiver):
            peer.close()
    push_s, copy_s = statistics.median(pushes), min(copies)
    return {
        "device": device, "memory": "VRAM" if device.startswith("cuda") else "DRAM",
        "layout": asdict(layout), "blocks": num_blocks, "chunks": len(parts), "push_bytes": push_bytes,
        "first_push_ms": first * 1e3, "push_ms": [s * 1e3 for s in pushes], "copy_ms": [s * 1e3 for s in copies],
        "push_gbps": push_bytes / push_s / 1e9, "copy_gbps": push_bytes / copy_s / 1e9,
        "push_over_copy": copy_s / push_s, "verified": True,
        "copy": "torch copy_ on the device" if device.startswith("cuda") else "libc memcpy (np.copyto)",
        "ucx_writes": ucx_writes(*logs),
    }
