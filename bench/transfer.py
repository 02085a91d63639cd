"""KV push bandwidth over NIXL against memcpy and a numpy gather of the same bytes.

    python -m bench.transfer [--tokens 2048] [--repeats 5] [--layouts smollm2,llama8b] [--json out.json]

Two worker processes (bench/harness/bandwidth_peers.py), a sender and a receiver, each hold a
block-major KV pool of 2x the pushed blocks. For each layout and each descriptor
granularity (regions_per_block = 1, num_layers, 2 * num_layers) they get fresh agents
and a handshake; the sender then pushes a prompt's KV (--tokens / 16 blocks, scattered
source blocks into scattered target blocks, fixed seed) with KVPusher in --chunks chunks,
the last one carrying DONE, the way a prefill worker will. The first push to a new peer
includes UCX connection set-up and is reported on its own; the next --repeats pushes are
timed from the first posted chunk to the sender's DONE event (median reported). The
receiver's target blocks are poisoned before the last push and compared, digest against
digest, with the sender's source blocks, so a fast but wrong push fails the run.

In the same run, on the same sender pool and the same number of bytes, all in one thread
(CMA copies in the posting thread): CMA, process_vm_writev of the same regions into the
same target blocks (the kernel copy UCX makes, without NIXL; median); memcpy, libc memcpy
of one contiguous buffer (best); torch, torch's copy_ of that buffer (best; one-thread
copy_ runs at about half of libc memcpy here, so it is shown but not used as the ceiling);
gather, a numpy take of the same scattered source blocks into a contiguous buffer
(median). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.harness.bandwidth_peers import receiver_main, sender_main
from transfer.handshake import agent_name
from transfer.layout import KVLayout

BLOCK_SIZE = 16
DTYPE = "bfloat16"
START_TIMEOUT_S = 180.0  # spawn + torch/NIXL import + pool allocation on a busy 2-core machine
CALL_TIMEOUT_S = 120.0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LayoutShape:
    label: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_layout(self, num_blocks: int, regions_per_block: int) -> KVLayout:
        return KVLayout(num_blocks, self.num_layers, BLOCK_SIZE, self.num_kv_heads, self.head_dim, DTYPE,
                        regions_per_block)

    def granularities(self) -> list[int]:
        return [1, self.num_layers, 2 * self.num_layers]


LAYOUTS = {
    "smollm2": LayoutShape("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64),  # 360 KiB/block
    "llama8b": LayoutShape("Llama-8B shape", num_layers=32, num_kv_heads=8, head_dim=128),  # 2 MiB/block
}


@dataclass
class Row:
    layout: str
    regions_per_block: int
    region_bytes: int
    push_bytes: int
    first_push_s: float
    push_s: list[float] = field(default_factory=list)
    cma_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    torch_copy_s: list[float] = field(default_factory=list)
    gather_s: list[float] = field(default_factory=list)

    def _gbps(self, seconds: float) -> float:
        return self.push_bytes / seconds / 1e9

    @property
    def push_gbps(self) -> float:  # the push and the scattered references: median
        return self._gbps(statistics.median(self.push_s))

    @property
    def cma_gbps(self) -> float:
        return self._gbps(statistics.median(self.cma_s))

    @property
    def gather_gbps(self) -> float:
        return self._gbps(statistics.median(self.gather_s))

    @property
    def memcpy_gbps(self) -> float:  # the contiguous copies: best, the machine's ceiling
        return self._gbps(min(self.memcpy_s))

    @property
    def torch_copy_gbps(self) -> float:
        return self._gbps(min(self.torch_copy_s))

    def rates(self) -> dict[str, float]:
        return dict(push_gbps=self.push_gbps, cma_gbps=self.cma_gbps, memcpy_gbps=self.memcpy_gbps,
                    torch_copy_gbps=self.torch_copy_gbps, gather_gbps=self.gather_gbps,
                    push_over_memcpy=self.push_gbps / self.memcpy_gbps, push_over_cma=self.push_gbps / self.cma_gbps)


class Worker:
    """One spawned peer process and its command pipe; every wait is bounded."""

    def __init__(self, ctx, target, name: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,), name=name, daemon=True)
        self.proc.start()
        child.close()

    def call(self, command: str, wait_s: float = CALL_TIMEOUT_S, **kwargs):
        """Run `command` in the worker and return its result; raise if it fails, dies or stalls."""
        deadline = time.monotonic() + wait_s
        try:
            self.conn.send((command, kwargs))
            while not self.conn.poll(0.2) and self.proc.is_alive() and time.monotonic() < deadline:
                pass
            if not self.conn.poll() and self.proc.is_alive():
                raise RuntimeError(f"{self.name}: no reply to {command} within {wait_s:.0f}s")
            kind, value = self.conn.recv()  # EOFError if it died without replying
        except (EOFError, OSError) as e:
            self.proc.join(1)
            raise RuntimeError(f"{self.name} exited (code {self.proc.exitcode}) during {command}: "
                               f"{type(e).__name__}") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed in {command}:\n{value}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop", {}))
                self.proc.join(5)
        except (OSError, EOFError):
            pass
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.conn.close()


class Bench:
    """Drives one sender and one receiver through every (layout, granularity) configuration."""

    def __init__(self, sender: Worker, receiver: Worker, args: argparse.Namespace):
        self.sender, self.receiver, self.args = sender, receiver, args
        self.num_blocks = -(-args.tokens // BLOCK_SIZE)
        rng = np.random.default_rng(args.seed)
        pool_blocks = 2 * self.num_blocks
        self.src = rng.permutation(pool_blocks)[:self.num_blocks].tolist()
        self.dst = rng.permutation(pool_blocks)[:self.num_blocks].tolist()
        self.chunks = [(s.tolist(), d.tolist()) for s, d in
                       zip(np.array_split(self.src, args.chunks), np.array_split(self.dst, args.chunks)) if len(s)]
        self.incarnation = 0

    def run_layout(self, name: str) -> list[Row]:
        shape = LAYOUTS[name]
        rows = []
        for rpb in shape.granularities():
            layout = shape.kv_layout(2 * self.num_blocks, rpb)
            log(f"{name}: {rpb} regions/block of {layout.region_bytes / 1024:g} KiB, "
                f"{self.num_blocks} blocks = {self.num_blocks * layout.block_bytes / 2**20:.1f} MiB per push")
            rows.append(self.run_config(name, layout))
            r = rows[-1]
            log(f"{name}: {rpb} regions/block: push {r.push_gbps:.2f} GB/s, CMA {r.cma_gbps:.2f}, memcpy "
                f"{r.memcpy_gbps:.2f}, gather {r.gather_gbps:.2f}, first push {r.first_push_s * 1e3:.1f} ms")
        return rows

    def run_config(self, name: str, layout: KVLayout) -> Row:
        self.incarnation += 1  # fresh agents, so every configuration pays (and reports) its own wire-up
        rx = self.receiver.call("setup", START_TIMEOUT_S, name=agent_name("decode", "0", self.incarnation),
                                  layout=asdict(layout))
        self.sender.call("setup", START_TIMEOUT_S, name=agent_name("prefill", "0", self.incarnation),
                         layout=asdict(layout), seed=self.args.seed)
        self.sender.call("connect", info=rx["info"], pid=rx["pid"], timeout_s=self.args.timeout)
        push_bytes = self.num_blocks * layout.block_bytes
        row = Row(name, layout.regions_per_block, layout.region_bytes, push_bytes,
                  first_push_s=self.push(f"warmup-{self.incarnation}", push_bytes, verify=False))
        for i in range(self.args.repeats):
            row.push_s.append(self.push(f"push-{self.incarnation}-{i}", push_bytes,
                                        verify=i == self.args.repeats - 1))
        copies = self.sender.call("copies", blocks=self.src, remote_blocks=self.dst, repeats=self.args.repeats)
        row.cma_s, row.memcpy_s, row.torch_copy_s, row.gather_s = (
            copies["cma"], copies["memcpy"], copies["torch_copy"], copies["gather"])
        self.sender.call("teardown")
        self.receiver.call("teardown")
        return row

    def push(self, request_id: str, push_bytes: int, verify: bool) -> float:
        """One push; returns the sender's seconds. With `verify`, targets are poisoned first and checked."""
        timeout = self.args.timeout
        self.receiver.call("expect", request_id=request_id, blocks=self.dst, poison=verify, timeout_s=timeout)
        sent = self.sender.call("push", timeout + 30, request_id=request_id, chunks=self.chunks, timeout_s=timeout)
        if not sent["ok"] or sent["num_bytes"] != push_bytes:
            raise RuntimeError(f"push {request_id}: {sent['status']} ({sent['reason'] or 'no reason'}), "
                               f"{sent['num_bytes']} of {push_bytes} bytes confirmed")
        got = self.receiver.call("wait", timeout + 30, request_id=request_id, blocks=self.dst, verify=verify,
                                 timeout_s=timeout)
        if got["status"] != "complete" or got["num_blocks"] != self.num_blocks:
            raise RuntimeError(f"push {request_id}: receiver saw {got['status']} with {got['num_blocks']} blocks, "
                               f"expected complete with {self.num_blocks}")
        if verify:
            want = self.sender.call("digest", blocks=self.src)
            if got["digest"] != want:
                raise RuntimeError(f"push {request_id}: target blocks differ from the source blocks "
                                   f"(digest {got['digest']} vs {want})")
        return sent["seconds"]


def render(args: argparse.Namespace, conditions: dict, rows: list[Row]) -> str:
    c = conditions
    n = args.repeats
    lines = [
        f"KV push over NIXL {c['nixl']} (UCX CMA, DRAM to DRAM between two processes), torch {c['torch']}: "
        f"{c['tokens']} tokens = {c['blocks']} blocks of {BLOCK_SIZE} in {c['chunks']} chunks, scattered source "
        f"and target blocks (seed {c['seed']}), pools of {2 * c['blocks']} blocks",
        f"push: sender-side time from the first posted chunk to DONE, median of {n} after one warm-up push per "
        "peer (first push ms: that warm-up, connection set-up included); the last push verified on the receiver",
        f"same bytes, same run: CMA = process_vm_writev of the same regions into the receiver, median of {n}; "
        f"memcpy = libc memcpy of one contiguous buffer, best of {n}; torch = torch copy_ of it, best of {n}; "
        f"gather = numpy take of the same scattered blocks, median of {n}; all one thread; "
        "GB/s = pushed bytes / seconds",
        "",
        f"{'layout':<16}{'regions/block':>14}{'region KiB':>12}{'push ms':>9}{'push GB/s':>11}{'CMA GB/s':>10}"
        f"{'memcpy GB/s':>13}{'torch GB/s':>12}{'gather GB/s':>13}{'push/memcpy':>13}{'first push ms':>15}",
    ]
    for r in rows:
        lines.append(
            f"{LAYOUTS[r.layout].label:<16}{r.regions_per_block:>14}{r.region_bytes / 1024:>12g}"
            f"{statistics.median(r.push_s) * 1e3:>9.2f}{r.push_gbps:>11.2f}{r.cma_gbps:>10.2f}"
            f"{r.memcpy_gbps:>13.2f}{r.torch_copy_gbps:>12.2f}{r.gather_gbps:>13.2f}"
            f"{r.push_gbps / r.memcpy_gbps:>12.2f}x{r.first_push_s * 1e3:>15.1f}")
    lines.append("")
    for name in dict.fromkeys(r.layout for r in rows):
        mine = [r for r in rows if r.layout == name]
        best = max(mine, key=lambda r: r.push_gbps)
        worst = min(mine, key=lambda r: r.push_gbps)
        to_cma = [r.push_gbps / r.cma_gbps for r in mine]
        lines.append(f"{LAYOUTS[name].label} ({mine[0].push_bytes / 2**20:.1f} MiB per push): fastest at "
                     f"{best.regions_per_block} regions/block ({best.region_bytes / 1024:g} KiB), "
                     f"{best.push_gbps / worst.push_gbps:.2f}x the slowest ({worst.regions_per_block} regions/block, "
                     f"{worst.region_bytes / 1024:g} KiB); push/CMA {min(to_cma):.2f}-{max(to_cma):.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens pushed (blocks of 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each measurement")
    p.add_argument("--chunks", type=int, default=4, help="chunks per push; the last carries DONE")
    p.add_argument("--layouts", default="smollm2,llama8b", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--seed", type=int, default=0, help="block ids and pool contents")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one push may take before it fails")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.layouts = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in args.layouts if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.tokens < 1 or args.repeats < 1 or args.chunks < 1:
        p.error("--tokens, --repeats and --chunks must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")  # no fork: NIXL/UCX state must not be inherited
    workers: list[Worker] = []
    try:
        log("starting sender and receiver processes")
        receiver = Worker(ctx, receiver_main, "receiver")
        workers.append(receiver)
        sender = Worker(ctx, sender_main, "sender")
        workers.append(sender)
        bench = Bench(sender, receiver, args)
        rows = [row for name in args.layouts for row in bench.run_layout(name)]
    finally:
        for w in reversed(workers):
            w.close()

    conditions = dict(tokens=args.tokens, blocks=bench.num_blocks, block_size=BLOCK_SIZE, chunks=len(bench.chunks),
                      repeats=args.repeats, seed=args.seed, dtype=DTYPE,
                      nixl=importlib.metadata.version("nixl-cu12"), torch=importlib.metadata.version("torch"))
    print(render(args, conditions, rows))
    if args.json:
        payload = dict(conditions=conditions, layouts={n: asdict(LAYOUTS[n]) for n in args.layouts},
                       rows=[dict(asdict(r), **r.rates()) for r in rows])
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
