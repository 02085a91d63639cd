"""KV push bandwidth over NIXL against memcpy and a numpy gather of the same bytes.

    python -m bench.transfer [--quick] [--tokens 2048] [--repeats 5] [--layouts smollm2,llama8b,dsv3-mla,dsv3-gqa]
        [--tp-pairs 1:1,2:2,4:4,2:1,1:2,4:2,2:4,4:1] [--tp-replicated 1:1,4:4,2:4,1:4,4:1]
        [--json bench/results/transfer.json]

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

Between tensor-parallel workers (transfer/ranks.py): for each pair of degrees in --tp-pairs
(sender:receiver) the sender holds a worker of the sending degree and the receiver one of
the receiving degree, each rank's pool holding its KV heads of a SmolLM2-shaped model with
--tp-kv-heads KV heads (--tp-replicated: pairs of a model with --tp-replicated-kv-heads,
fewer than the largest degree, so some ranks hold the same head). Every pair pushes the same
blocks, the model's whole KV of them, with one agent per degree on each side for the whole
run; the pairs take turns push by push (A B C A B C), so background load falls on all
alike. Reported per pair: the regions its writes post (counted as the pusher posts them, and
checked against the bench's own account of them: whole blocks to a receiving rank whose
heads are one sending rank's, else that rank's heads packed into whole blocks in staging
memory), the regions the per-row path would post (one per (layer, K/V, token) row and run
of heads: the push before staging), and in each turn, in the sender process, the pack of
the staged ranks' heads of the same chunks (`pack_blocks`, as the pusher packs) timed on its
own, one process_vm_writev of the regions posted (CMA: the packed blocks for staged ranks)
and one libc memcpy of the same bytes. The last push of each pair is verified rank by rank:
each receiving rank's target blocks against its heads' slice of the sender's full-head
reference pool. GB/s there = the model's KV bytes pushed / seconds (a replica's bytes are
written but not counted again).

Results go to stdout and, as JSON, to --json (default bench/results/transfer.json, or
transfer_quick.json with --quick).
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
from pathlib import Path

import numpy as np

from bench.harness.bandwidth_peers import receiver_main, sender_main
from bench.host_cpu import host_cpu
from transfer.handshake import agent_name
from transfer.layout import KVLayout

BLOCK_SIZE = 16
DTYPE = "bfloat16"
START_TIMEOUT_S = 180.0  # spawn + torch/NIXL import + pool allocation on a busy 2-core machine
CALL_TIMEOUT_S = 120.0
RESULTS = Path(__file__).resolve().parent / "results"
TP_SHAPE = (30, 64)  # SmolLM2-135M's layers and head_dim; the KV head count is the bench's choice


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
    # DeepSeek-V3's latent pool: 61 layers, one entry of 512 + 64 a token, halved over the K and V
    # planes (engine/config.py), 1.1 MiB/block; beside it a GQA model of its hidden size (7168 =
    # 56 heads of 128) and layers with 8 KV heads, as Llama-70B has them: 3.8 MiB/block
    "dsv3-mla": LayoutShape("DeepSeek-V3 MLA", num_layers=61, num_kv_heads=1, head_dim=288),
    "dsv3-gqa": LayoutShape("GQA same shape", num_layers=61, num_kv_heads=8, head_dim=128),
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


@dataclass(frozen=True)
class TPGroup:
    """Pairs of degrees pushing one model's KV; the first pair, 1:1, is the others' baseline."""

    kv_heads: int
    pairs: tuple[tuple[int, int], ...]  # (sender degree, receiver degree)

    @property
    def label(self) -> str:
        return f"SmolLM2 shape, {self.kv_heads} KV heads"

    @property
    def degrees(self) -> list[int]:
        return sorted({d for pair in self.pairs for d in pair})

    def kv_layout(self, num_blocks: int) -> KVLayout:
        layers, head_dim = TP_SHAPE
        return KVLayout(num_blocks, layers, BLOCK_SIZE, self.kv_heads, head_dim, DTYPE)


@dataclass
class TPRow:
    kv_heads: int
    src_degree: int
    dst_degree: int
    regions: int  # what the push posts (counted from its writes): one per block per receiving rank, unless rows
    staged_ranks: int  # receiving ranks whose heads the sender packs into staging
    row_regions_per_block: int  # what the per-row path posts: the push before staging, for comparison
    num_blocks: int
    kv_bytes: int  # the model's KV of the pushed blocks
    written_bytes: int  # what the write moves: more than kv_bytes where receiving ranks hold replicas
    first_push_s: float
    push_s: list[float] = field(default_factory=list)
    pack_s: list[float] = field(default_factory=list)  # pack_blocks of the staged ranks, in the same turns
    cma_s: list[float] = field(default_factory=list)
    verified_ranks: int = 0

    @property
    def pair(self) -> str:
        return f"{self.src_degree}:{self.dst_degree}"

    @property
    def regions_per_block(self) -> float:
        return self.regions / self.num_blocks

    @property
    def region_bytes(self) -> float:
        return self.written_bytes / self.regions

    @property
    def pack_ms(self) -> float | None:
        return statistics.median(self.pack_s) * 1e3 if self.pack_s else None

    @property
    def write_ms(self) -> float:
        """The push less its pack, turn by turn (median): NIXL's part of it."""
        packs = self.pack_s or [0.0] * len(self.push_s)
        return statistics.median(p - q for p, q in zip(self.push_s, packs)) * 1e3

    @property
    def push_gbps(self) -> float:
        return self.kv_bytes / statistics.median(self.push_s) / 1e9

    @property
    def cma_gbps(self) -> float:
        return self.kv_bytes / statistics.median(self.cma_s) / 1e9

    def rates(self, base: TPRow, memcpy_s: list[float]) -> dict[str, float | None]:
        memcpy_gbps = self.kv_bytes / min(memcpy_s) / 1e9
        return dict(push_gbps=self.push_gbps, cma_gbps=self.cma_gbps, memcpy_gbps=memcpy_gbps,
                    push_over_1to1=self.push_gbps / base.push_gbps, push_over_memcpy=self.push_gbps / memcpy_gbps,
                    push_over_cma=self.push_gbps / self.cma_gbps, regions_per_block=self.regions_per_block,
                    region_bytes=self.region_bytes, pack_ms=self.pack_ms, write_ms=self.write_ms)


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

    def run_tp(self, group: TPGroup) -> tuple[list[TPRow], list[float]]:
        """Every pair of `group`, push by push in turn; returns its rows and the memcpy seconds."""
        self.incarnation += 1
        layout = asdict(group.kv_layout(2 * self.num_blocks))
        tag = f"{group.kv_heads}kv"
        rx = self.receiver.call("tp_setup", START_TIMEOUT_S, layout=layout, names={
            d: agent_name("decode", f"{tag}x{d}", self.incarnation) for d in group.degrees})
        self.sender.call("tp_setup", START_TIMEOUT_S, layout=layout, seed=self.args.seed, names={
            d: agent_name("prefill", f"{tag}x{d}", self.incarnation) for d in group.degrees})
        self.sender.call("tp_connect", infos=rx["infos"], pid=rx["pid"], timeout_s=self.args.timeout)
        kv_bytes = self.num_blocks * group.kv_layout(1).block_bytes
        rows = []
        for src, dst in group.pairs:
            shape = self.sender.call("tp_pair", src=src, dst=dst, chunks=self.chunks)
            written, regions = shape["written_bytes"], shape["regions"]
            first = self.tp_push(src, dst, f"tp-{tag}-{src}-{dst}-warmup-{self.incarnation}", written, None, regions)
            rows.append(TPRow(group.kv_heads, src, dst, regions, shape["staged_ranks"], shape["row_regions_per_block"],
                              self.num_blocks, kv_bytes, written, first))
            log(f"{group.label} {src}:{dst}: {regions / self.num_blocks:g} regions/block "
                f"({shape['staged_ranks']} receiving rank(s) staged; the per-row path: "
                f"{shape['row_regions_per_block']}), first push {first * 1e3:.1f} ms")
        memcpy_s = []
        for i in range(self.args.repeats):
            last = i == self.args.repeats - 1
            for row in rows:  # A B C, A B C: the pairs share whatever else the machine does
                heads = rx["heads"][row.dst_degree] if last else None
                row.push_s.append(self.tp_push(row.src_degree, row.dst_degree,
                                               f"tp-{tag}-{row.pair}-{i}-{self.incarnation}", row.written_bytes, heads,
                                               row.regions))
                copies = self.sender.call("tp_copies", src=row.src_degree, dst=row.dst_degree, chunks=self.chunks)
                if copies["pack"] is not None:
                    row.pack_s.append(copies["pack"])
                row.cma_s.append(copies["cma"])
                row.verified_ranks += len(heads or ())
            memcpy_s.append(self.sender.call("tp_memcpy", num_blocks=self.num_blocks))
        self.sender.call("tp_teardown")
        self.receiver.call("tp_teardown")
        for row in rows:
            log(f"{group.label} {row.pair}: push {row.push_gbps:.2f} GB/s ({row.push_gbps / rows[0].push_gbps:.2f}x "
                f"1:1), CMA {row.cma_gbps:.2f}, memcpy {kv_bytes / min(memcpy_s) / 1e9:.2f}")
        return rows, memcpy_s

    def tp_push(self, src: int, dst: int, request_id: str, written_bytes: int | None,
                heads: list[list[int]] | None, regions: int | None = None) -> float:
        """One push from the degree-`src` worker into the degree-`dst` one; returns the sender's
        seconds. With `heads` (the receiving ranks' [start, count]), the targets are poisoned
        first and each rank's blocks checked against its heads of the sender's reference; with
        `regions`, the regions its writes posted must be as many."""
        timeout = self.args.timeout
        self.receiver.call("tp_expect", degree=dst, request_id=request_id, blocks=self.dst, poison=bool(heads),
                           timeout_s=timeout)
        sent = self.sender.call("tp_push", timeout + 30, src=src, dst=dst, request_id=request_id,
                                chunks=self.chunks, timeout_s=timeout)
        if not sent["ok"] or (written_bytes is not None and sent["num_bytes"] != written_bytes):
            raise RuntimeError(f"push {request_id}: {sent['status']} ({sent['reason'] or 'no reason'}), "
                               f"{sent['num_bytes']} of {written_bytes} bytes confirmed")
        if regions is not None and sent["posted_regions"] != regions:
            raise RuntimeError(f"push {request_id}: posted {sent['posted_regions']} regions where the bench "
                               f"accounts for {regions} (bench/harness/bandwidth_peers.py `_tp_posted`)")
        got = self.receiver.call("tp_wait", timeout + 30, degree=dst, request_id=request_id, blocks=self.dst,
                                 verify=bool(heads), timeout_s=timeout)
        if got["status"] != "complete" or got["num_blocks"] != self.num_blocks:
            raise RuntimeError(f"push {request_id}: receiver saw {got['status']} with {got['num_blocks']} blocks, "
                               f"expected complete with {self.num_blocks}")
        if heads:
            want = self.sender.call("tp_expected", heads=heads, blocks=self.src)
            wrong = [r for r, (g, w) in enumerate(zip(got["digests"], want)) if g != w]
            if wrong:
                raise RuntimeError(f"push {request_id}: receiving rank(s) {wrong} do not hold their KV heads "
                                   f"{[heads[r] for r in wrong]} of the source blocks")
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
        shape = LAYOUTS[name]
        per_layer = 2 * shape.num_kv_heads * shape.head_dim * 2  # bytes a token, one layer, bfloat16
        lines.append(f"{shape.label} ({mine[0].push_bytes / 2**20:.1f} MiB per push): fastest at "
                     f"{best.regions_per_block} regions/block ({best.region_bytes / 1024:g} KiB), "
                     f"{best.push_gbps / worst.push_gbps:.2f}x the slowest ({worst.regions_per_block} regions/block, "
                     f"{worst.region_bytes / 1024:g} KiB); push/CMA {min(to_cma):.2f}-{max(to_cma):.2f}x; "
                     f"KV {per_layer} B a token a layer, {per_layer * shape.num_layers} B a token; push "
                     f"{statistics.median(best.push_s) / c['tokens'] * 1e6:.2f} us a prompt token")
    return "\n".join(lines)


def render_tp(args: argparse.Namespace, conditions: dict,
              groups: list[tuple[TPGroup, list[TPRow], list[float]]]) -> str:
    c, n = conditions, args.repeats
    lines = [
        f"KV push between tensor-parallel workers (sender degree : receiver degree), SmolLM2 shape ({TP_SHAPE[0]} "
        f"layers, head_dim {TP_SHAPE[1]}, blocks of {BLOCK_SIZE}, {DTYPE}): {c['blocks']} blocks, the model's whole "
        f"KV, in {c['chunks']} chunks, scattered source and target blocks (seed {c['seed']}); one agent per degree "
        "on each side",
        "regions/block: what the push posts (counted from its writes), whole blocks to each receiving rank, packed "
        "first into staging for the staged ranks; rows/block: what the per-row path (the push before staging, still "
        "used for a chunk larger than the staging area) would post",
        f"push: median of {n}, the pairs taking turns push by push after one warm-up push each; pack: the sender's "
        f"pack_blocks of the same chunks, median of {n}, timed in the same turns; write: push - pack, turn by turn; "
        f"CMA: one process_vm_writev of the regions posted (the packed blocks for staged ranks), median of {n}; "
        f"memcpy: libc memcpy of the same bytes, best of {n}; GB/s = the model's KV bytes / seconds; the last push "
        "of each pair verified rank by rank",
        "",
        f"{'model':<26}{'pair':>6}{'regions/block':>15}{'region KiB':>12}{'staged':>8}{'rows/block':>12}"
        f"{'written/KV':>12}{'push ms':>10}{'pack ms':>9}{'write ms':>10}{'CMA ms':>9}{'push GB/s':>11}"
        f"{'memcpy GB/s':>13}{'push/1:1':>10}{'push/memcpy':>13}{'first push ms':>15}",
    ]
    for group, rows, memcpy_s in groups:
        for r in rows:
            rates = r.rates(rows[0], memcpy_s)
            pack = f"{r.pack_ms:.2f}" if r.pack_ms is not None else "-"
            lines.append(
                f"{group.label:<26}{r.pair:>6}{r.regions_per_block:>15g}{r.region_bytes / 1024:>12g}"
                f"{r.staged_ranks:>8}{r.row_regions_per_block:>12}{r.written_bytes / r.kv_bytes:>12.2f}"
                f"{statistics.median(r.push_s) * 1e3:>10.2f}{pack:>9}{r.write_ms:>10.2f}"
                f"{statistics.median(r.cma_s) * 1e3:>9.2f}{r.push_gbps:>11.2f}{rates['memcpy_gbps']:>13.2f}"
                f"{rates['push_over_1to1']:>9.3f}x{rates['push_over_memcpy']:>12.3f}x{r.first_push_s * 1e3:>15.1f}")
    return "\n".join(lines)


def _pairs(text: str, flag: str, p: argparse.ArgumentParser) -> tuple[tuple[int, int], ...]:
    """'1:1,2:1' -> ((1, 1), (2, 1)), with 1:1 first (the baseline) and no repeats."""
    pairs = []
    for item in filter(None, text.split(",")):
        try:
            src, dst = (int(x) for x in item.split(":"))
        except ValueError:
            p.error(f"{flag}: {item!r} is not SENDER:RECEIVER degrees, e.g. 2:1")
        if src < 1 or dst < 1:
            p.error(f"{flag}: {item!r}: degrees must be at least 1")
        pairs.append((src, dst))
    if not pairs:
        return ()
    return tuple(dict.fromkeys([(1, 1), *pairs]))


def _check_degrees(group: TPGroup, flag: str, p: argparse.ArgumentParser) -> None:
    for d in group.degrees:  # the rule of engine/parallel/layout.py
        if group.kv_heads % d and d % group.kv_heads:
            p.error(f"{flag}: degree {d} neither divides {group.kv_heads} KV heads nor is a multiple of them")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="256 tokens, 2 repeats, SmolLM2 only, pairs 2:2, 2:1, 1:2 and replicated 4:1: a check, "
                   "not figures")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens pushed (blocks of 16; default 2048)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each measurement (default 5)")
    p.add_argument("--chunks", type=int, default=4, help="chunks per push; the last carries DONE")
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated, from {', '.join(LAYOUTS)} (default all; '' for none)")
    p.add_argument("--tp-pairs", default=None, help="SENDER:RECEIVER tensor-parallel degrees, comma-separated "
                   "(default 1:1,2:2,4:4,2:1,1:2,4:2,2:4,4:1; 1:1, the baseline, is always added; '' for none)")
    p.add_argument("--tp-kv-heads", type=int, default=4, help="KV heads of the --tp-pairs model")
    p.add_argument("--tp-replicated", default=None, help="pairs of the --tp-replicated-kv-heads model "
                   "(default 1:1,4:4,2:4,1:4,4:1; '' for none)")
    p.add_argument("--tp-replicated-kv-heads", type=int, default=2,
                   help="KV heads of the --tp-replicated model (fewer than a degree: replicas)")
    p.add_argument("--seed", type=int, default=0, help="block ids and pool contents")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one push may take before it fails")
    p.add_argument("--json", metavar="PATH", help="where the JSON results go (default "
                   "bench/results/transfer.json, transfer_quick.json with --quick; '' for none)")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(tokens=256 if quick else 2048, repeats=2 if quick else 5,
                    layouts="smollm2" if quick else "smollm2,llama8b,dsv3-mla,dsv3-gqa",
                    tp_pairs="2:2,2:1,1:2" if quick else "1:1,2:2,4:4,2:1,1:2,4:2,2:4,4:1",
                    tp_replicated="4:1" if quick else "1:1,4:4,2:4,1:4,4:1",
                    json=str(RESULTS / ("transfer_quick.json" if quick else "transfer.json")))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.layouts = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in args.layouts if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.tokens < 1 or args.repeats < 1 or args.chunks < 1:
        p.error("--tokens, --repeats and --chunks must be at least 1")
    args.tp_groups = []
    for flag, heads, text in (("--tp-pairs", args.tp_kv_heads, args.tp_pairs),
                              ("--tp-replicated", args.tp_replicated_kv_heads, args.tp_replicated)):
        pairs = _pairs(text, flag, p)
        if pairs:
            if heads < 1:
                p.error(f"{flag}: the model needs at least one KV head")
            args.tp_groups.append(TPGroup(heads, pairs))
            _check_degrees(args.tp_groups[-1], flag, p)
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
        tp = [(group, *bench.run_tp(group)) for group in args.tp_groups]
    finally:
        for w in reversed(workers):
            w.close()

    conditions = dict(tokens=args.tokens, blocks=bench.num_blocks, block_size=BLOCK_SIZE, chunks=len(bench.chunks),
                      repeats=args.repeats, seed=args.seed, dtype=DTYPE,
                      nixl=importlib.metadata.version("nixl-cu12"), torch=importlib.metadata.version("torch"),
                      cpu=host_cpu().name)
    if rows:
        print(render(args, conditions, rows))
    if tp:
        print("\n" if rows else "", end="")
        print(render_tp(args, conditions, tp))
    if args.json:
        payload = dict(conditions=conditions, layouts={n: asdict(LAYOUTS[n]) for n in args.layouts},
                       rows=[dict(asdict(r), **r.rates()) for r in rows],
                       tp=[dict(model=dict(label=g.label, num_layers=TP_SHAPE[0], head_dim=TP_SHAPE[1],
                                           num_kv_heads=g.kv_heads, block_size=BLOCK_SIZE),
                                memcpy_s=memcpy_s,
                                rows=[dict(asdict(r), pair=r.pair, **r.rates(tp_rows[0], memcpy_s)) for r in tp_rows])
                           for g, tp_rows, memcpy_s in tp])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
