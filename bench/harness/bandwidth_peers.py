"""The two processes of `python -m bench.transfer`: a sender pool that pushes, a receiver
pool that is written. (The transfer tests' peers are transfer_peers.py beside this:
small pools checked byte for byte, every event recorded, no timing.)

Each runs a command loop on a Pipe from the coordinator: a command is `(name, kwargs)`,
the reply `("ok", value)` or `("error", traceback text)`, so a failure inside a worker
reaches the coordinator as a message instead of a hang. The receiver keeps polling NIXL
between commands (a passive side must, or wire-up never completes), the way a decode
worker's loop would; the sender only acts on commands.

Pools are block-major like engine/kv_cache.py and touched before any timing, so no
measurement pays for page faults. Byte checks are BLAKE2 digests of the blocks in order,
which catch a block written to the wrong place as well as a block not written at all.

The `tp_*` commands hold tensor-parallel workers of several degrees at once (one agent per
degree, each registering its degree's rank pools: transfer/ranks.py), so the coordinator
can push between every pair of degrees in turn without new agents: the sender's pools are
slices of one full-head reference pool, and a receiving rank is checked against its heads'
slice of that reference.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch

from transfer.agent import TransferAgent
from transfer.handshake import TransferInfo
from transfer.layout import KVLayout, region_indices, region_table
from transfer.push import KVPusher, PushStatus
from transfer.ranks import Piece, block_descriptors, pack_blocks, write_pieces
from transfer.receive import KVReceiver
from transfer.staging import ALIGN as STAGING_ALIGN
from transfer.staging import DEFAULT_CAPACITY as STAGING_CAPACITY

MODEL = "bench-transfer"  # both sides publish the same name; only the layout matters here
IDLE_POLL_S = 0.0005  # the receiver's loop period while waiting for a command
POISON = 0xA5A5A5A5A5A5A5A5  # target blocks are filled with this before the verified push


def _alloc_pool(layout: KVLayout) -> torch.Tensor:
    # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    return torch.empty(layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                       layout.head_dim, dtype=torch.bfloat16)


def _rows(pool: torch.Tensor, num_blocks: int) -> np.ndarray:
    """[num_blocks, block_bytes // 8] uint64 numpy view of the pool (shares memory)."""
    return pool.view(-1).view(torch.int64).numpy().view(np.uint64).reshape(num_blocks, -1)


def _digest(rows: np.ndarray, blocks: list[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for b in blocks:
        h.update(rows[b])
    return h.hexdigest()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                    ctypes.c_ulong]
IOV_MAX = 1024


def _cma_write(pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """process_vm_writev of [n, 2] uint64 (address, length) rows (laid out as struct iovec)."""
    for s in range(0, len(local), IOV_MAX):
        m = min(IOV_MAX, len(local) - s)
        want = int(local[s:s + m, 1].sum())
        got = _libc.process_vm_writev(pid, local.ctypes.data + 16 * s, m, remote.ctypes.data + 16 * s, m, 0)
        if got != want:
            raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got} of {want} bytes")


def rank_heads(num_kv_heads: int, degree: int) -> list[range]:
    """Each rank's KV heads at `degree`, the rule of engine/parallel/layout.py: sharded when the
    degree divides the heads, else each head replicated on degree / heads ranks."""
    if num_kv_heads >= degree:
        per = num_kv_heads // degree
        return [range(r * per, (r + 1) * per) for r in range(degree)]
    replicas = degree // num_kv_heads
    return [range(r // replicas, r // replicas + 1) for r in range(degree)]


def _count_posted(agent: TransferAgent, counts: dict[int, int], key: int) -> None:
    """Add to `counts[key]` the local regions of every write `agent` posts (the rows of the
    descriptor list built for `initialize_xfer`, or the prepped indices), so the bench reports
    what the pusher posted rather than what the bench expects it to."""
    nixl = agent.nixl
    get_descs, prepped = nixl.get_xfer_descs, nixl.make_prepped_xfer
    local_side = [True]  # the pusher builds the local list, then the remote one

    def counted_descs(descs, *args, **kwargs):
        if local_side[0]:
            counts[key] += len(descs)
        local_side[0] = not local_side[0]
        return get_descs(descs, *args, **kwargs)

    def counted_prepped(operation, local_dlist, local_indices, *args, **kwargs):
        counts[key] += len(local_indices)
        return prepped(operation, local_dlist, local_indices, *args, **kwargs)

    nixl.get_xfer_descs, nixl.make_prepped_xfer = counted_descs, counted_prepped


class _Ranked:
    """One tensor-parallel worker of the bench: its rank pools and the agent registering them."""

    def __init__(self, name: str, full: KVLayout, degree: int, fill: torch.Tensor | None) -> None:
        self.heads = rank_heads(full.num_kv_heads, degree)
        self.layout = KVLayout(full.num_blocks, full.num_layers, full.block_size, len(self.heads[0]),
                               full.head_dim, full.dtype)
        if degree == 1 and fill is not None:
            self.pools = [fill]  # the reference itself
        else:
            self.pools = [_alloc_pool(self.layout) for _ in self.heads]
            for pool, h in zip(self.pools, self.heads):
                if fill is None:
                    _rows(pool, full.num_blocks).fill(POISON)
                else:  # as int16, so the copy keeps every bit pattern (random bytes hold NaNs)
                    pool.view(torch.int16).copy_(fill.view(torch.int16)[..., h.start:h.stop, :])
        self.rows = [_rows(pool, full.num_blocks) for pool in self.pools]
        ranks = [(pool.view(-1), h) for pool, h in zip(self.pools, self.heads)] if degree > 1 else None
        self.agent = TransferAgent(name, self.pools[0].view(-1), self.layout, MODEL, ranks=ranks)


class _Side:
    """What both workers share: one pool per layout shape, one agent per configuration."""

    def __init__(self) -> None:
        self.pool: torch.Tensor | None = None
        self.rows: np.ndarray | None = None
        self.agent: TransferAgent | None = None

    def _new_agent(self, name: str, layout: dict) -> tuple[KVLayout, bool]:
        """Create this configuration's agent; (re)allocate the pool when its size changes."""
        self.teardown()
        kv = KVLayout(**layout)
        fresh = self.pool is None or self.pool.numel() * self.pool.element_size() != kv.pool_bytes
        if fresh:
            self.pool = self.rows = None
            gc.collect()
            self.pool = _alloc_pool(kv)
            self.rows = _rows(self.pool, kv.num_blocks)
        self.agent = TransferAgent(name, self.pool.view(-1), kv, MODEL)
        return kv, fresh

    def teardown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
            gc.collect()


class SenderSide(_Side):
    def __init__(self) -> None:
        super().__init__()
        self.pusher: KVPusher | None = None
        self.peer = ""
        self.peer_pid = 0
        self.scratch: np.ndarray | None = None
        self.tp_workers: dict[int, _Ranked] = {}  # degree -> worker
        self.tp_pushers: dict[int, KVPusher] = {}
        self.tp_peers: dict[int, str] = {}  # the receiver's degree -> its agent name
        self.tp_full: torch.Tensor | None = None  # every KV head: the reference the ranks are sliced from
        self.tp_full_rows: np.ndarray | None = None
        self.tp_scratch: torch.Tensor | None = None  # where tp_copies packs, as the pusher does into staging
        self.tp_posted: dict[int, int] = {}  # degree -> rows of the descriptor lists its agent built

    def setup(self, name: str, layout: dict, seed: int) -> None:
        kv, fresh = self._new_agent(name, layout)
        if fresh:  # random bytes, so a missed or misplaced block cannot match by chance
            np.random.default_rng(seed).random(out=self.rows.view(np.float64))
            self.scratch = None

    def connect(self, info: bytes, pid: int, timeout_s: float) -> str:
        self.peer = self.agent.add_peer(TransferInfo.from_bytes(info))
        self.peer_pid = pid
        self.pusher = KVPusher(self.agent, default_timeout_s=timeout_s)
        return self.peer

    def push(self, request_id: str, chunks: list[tuple[list[int], list[int]]], timeout_s: float) -> dict:
        """Post every chunk (the last one carries DONE) and poll until the push ends.

        Timed from just before the first chunk is posted to the poll that returns the
        event: the sender-side latency the serving loop sees.
        """
        pusher = self.pusher
        guard = time.monotonic() + timeout_s + 5.0  # the pusher's own timeout fires first
        t0 = time.perf_counter()
        pusher.start(request_id, self.peer, timeout_s)
        for i, (local, remote) in enumerate(chunks):
            pusher.push(request_id, local, remote, last=i == len(chunks) - 1)
        while not (events := pusher.poll()):
            if time.monotonic() > guard:
                raise TimeoutError(f"push {request_id}: no event from the pusher within {timeout_s + 5:.0f}s")
        seconds = time.perf_counter() - t0
        ev = events[0]
        return {"status": ev.status.value, "ok": ev.status is PushStatus.DONE, "reason": ev.reason,
                "seconds": seconds, "num_bytes": ev.num_bytes}

    def digest(self, blocks: list[int]) -> str:
        return _digest(self.rows, blocks)

    def copies(self, blocks: list[int], remote_blocks: list[int], repeats: int) -> dict[str, list[float]]:
        """Same-bytes references, each timed `repeats` times after one warm-up.

        memcpy / torch_copy: the pool's first len(blocks) blocks (one contiguous range) into a
        contiguous buffer, by libc memcpy (np.copyto) and by torch's copy_ (one thread).
        gather: the scattered `blocks` rows into that buffer (numpy take).
        cma: process_vm_writev of `blocks` into the peer's `remote_blocks`, one iovec per
        region of this configuration: the kernel copy UCX's CMA transport makes, without NIXL.
        """
        n = len(blocks)
        if self.scratch is None or self.scratch.shape[0] != n:
            self.scratch = np.zeros((n, self.rows.shape[1]), dtype=np.uint64)
            self.scratch.fill(1)  # touch every page before timing
        src = self.rows[:n]
        idx = np.asarray(blocks, dtype=np.intp)
        layout, peer = self.agent.layout, self.agent.peer(self.peer).info
        r = layout.regions_per_block
        local = region_table(self.pool.data_ptr(), layout)[region_indices(blocks, r), :2].astype(np.uint64)
        remote = region_table(peer.base_addr, layout)[region_indices(remote_blocks, r), :2].astype(np.uint64)
        tsrc, tdst = torch.from_numpy(src), torch.from_numpy(self.scratch)
        cases = {
            "memcpy": lambda: np.copyto(self.scratch, src),
            "torch_copy": lambda: tdst.copy_(tsrc),
            # mode="clip": with the default "raise", numpy gathers into a temporary and copies again
            "gather": lambda: np.take(self.rows, idx, axis=0, out=self.scratch, mode="clip"),
            "cma": lambda: _cma_write(self.peer_pid, local, remote),
        }
        timings: dict[str, list[float]] = {}
        for name, fn in cases.items():
            fn()
            timings[name] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - t0)
        if _digest(self.scratch, list(range(n))) != _digest(self.rows, blocks):
            raise RuntimeError("numpy gather produced different bytes than the source blocks")
        return timings

    def tp_setup(self, names: dict[int, str], layout: dict, seed: int) -> None:
        """One worker per degree (`names`: degree -> agent name) of the model `layout` (every
        KV head), its pools filled from one random full-head reference pool."""
        self.tp_teardown()
        full = KVLayout(**layout)
        self.tp_full = _alloc_pool(full)
        self.tp_full_rows = _rows(self.tp_full, full.num_blocks)
        np.random.default_rng(seed).random(out=self.tp_full_rows.view(np.float64))
        self.tp_workers = {d: _Ranked(name, full, d, self.tp_full) for d, name in names.items()}
        self.tp_pushers = {d: KVPusher(w.agent) for d, w in self.tp_workers.items()}
        self.tp_posted = dict.fromkeys(names, 0)
        for d, w in self.tp_workers.items():
            _count_posted(w.agent, self.tp_posted, d)

    def tp_connect(self, infos: dict[int, bytes], pid: int, timeout_s: float) -> None:
        """Every sending degree adds every receiving one (`infos`: degree -> transfer info)."""
        self.peer_pid = pid
        for d, info in infos.items():
            parsed = TransferInfo.from_bytes(info)
            for w in self.tp_workers.values():
                self.tp_peers[d] = w.agent.add_peer(parsed)
        for pusher in self.tp_pushers.values():
            pusher.default_timeout_s = timeout_s

    def tp_push(self, src: int, dst: int, request_id: str, chunks: list[tuple[list[int], list[int]]],
                timeout_s: float) -> dict:
        """`push` from the degree-`src` worker into the degree-`dst` one, with the regions its
        writes posted (`posted_regions`)."""
        self.pusher, self.peer = self.tp_pushers[src], self.tp_peers[dst]
        before = self.tp_posted[src]
        try:
            return dict(self.push(request_id, chunks, timeout_s), posted_regions=self.tp_posted[src] - before)
        finally:
            self.pusher = None

    def _tp_posted(self, src: int, dst: int, chunks: list[tuple[list[int], list[int]]],
                   scratch_addr: int = 0) -> tuple[np.ndarray, list[tuple[int, list[Piece], list[int], int]]]:
        """What a push of `chunks` from degree `src` into degree `dst` posts, built as the pusher
        builds it (transfer/push.py `_rank_rows`): the prepped whole-block regions between one-rank
        workers; else whole blocks rank to rank where a receiving rank holds exactly one sending
        rank's heads, the other receiving ranks' heads packed into whole blocks (staged, here at
        `scratch_addr` onwards, chunk after chunk), and per-row regions for a chunk too large to
        stage. Returns [n, 4] uint64 rows (local address, length, remote address, length) and the
        packs: (receiving rank, its pieces, a chunk's local blocks, offset from `scratch_addr`)."""
        agent = self.tp_workers[src].agent
        peer = agent.peer(self.tp_peers[dst]).info
        if not agent.ranks and not peer.ranks:
            r = agent.layout.regions_per_block
            blocks = [b for local, _ in chunks for b in local]
            remote_blocks = [b for _, remote in chunks for b in remote]
            local = region_table(agent.pool.data_ptr(), agent.layout)[region_indices(blocks, r)]
            remote = region_table(peer.base_addr, peer.layout)[region_indices(remote_blocks, r)]
            return np.concatenate([local[:, :2], remote[:, :2]], axis=1).astype(np.uint64), []
        ours, theirs = agent.side, peer.side
        pieces = write_pieces(ours, theirs)
        whole = [q for q in pieces if q.whole]
        packed = sorted({q.dst_rank for q in pieces if not q.whole})
        block_bytes = theirs.layout.block_bytes
        rows, packs, offset = [], [], 0
        for local_blocks, remote_blocks in chunks:
            if whole:
                rows.append(block_descriptors(whole, ours, theirs, local_blocks, remote_blocks))
            n = len(local_blocks)
            for d in packed:
                mine = [q for q in pieces if q.dst_rank == d]
                if -(-n * block_bytes // STAGING_ALIGN) * STAGING_ALIGN > STAGING_CAPACITY:  # rows, as the pusher
                    rows.append(block_descriptors(mine, ours, theirs, local_blocks, remote_blocks))
                    continue
                packs.append((d, mine, local_blocks, offset))
                size = np.full(n, block_bytes, dtype=np.int64)
                at = scratch_addr + offset + np.arange(n, dtype=np.int64) * block_bytes
                to = theirs.ranks[d].base_addr + np.asarray(remote_blocks, dtype=np.int64) * block_bytes
                rows.append((np.stack([at, size], axis=1), np.stack([to, size], axis=1)))
                offset += n * block_bytes
        local = np.concatenate([r[0][:, :2] for r in rows])
        remote = np.concatenate([r[1][:, :2] for r in rows])
        return np.concatenate([local, remote], axis=1).astype(np.uint64), packs

    def tp_pair(self, src: int, dst: int, chunks: list[tuple[list[int], list[int]]]) -> dict:
        """What a push of `chunks` from `src` into `dst` posts: regions, bytes written (replicas
        count once each), receiving ranks packed into staging; and the regions per block the
        per-row path posts (one per (layer, K/V, token) row and run of heads where a receiving
        rank's heads are not one sending rank's), for comparison."""
        rows, packs = self._tp_posted(src, dst, chunks)
        agent = self.tp_workers[src].agent
        peer = agent.peer(self.tp_peers[dst]).info
        by_row = len(rows) // sum(len(local) for local, _ in chunks) if not agent.ranks and not peer.ranks else \
            len(block_descriptors(write_pieces(agent.side, peer.side), agent.side, peer.side, [0], [0])[0])
        return {"regions": len(rows), "written_bytes": int(rows[:, 1].sum()),
                "staged_ranks": len({d for d, *_ in packs}), "row_regions_per_block": by_row}

    def tp_copies(self, src: int, dst: int, chunks: list[tuple[list[int], list[int]]]) -> dict:
        """The sender's side of the pair's push without NIXL, each timed once: `pack`, the
        pusher's `pack_blocks` of every staged rank's heads, chunk by chunk, into scratch memory
        (None where nothing is staged); `cma`, one process_vm_writev of the regions the push
        posts (the packed blocks for staged ranks) into the same target blocks: the kernel's
        copy UCX's CMA transport makes."""
        agent = self.tp_workers[src].agent
        _, packs = self._tp_posted(src, dst, chunks)
        need = sum(len(local) for _, _, local, _ in packs) * agent.peer(self.tp_peers[dst]).info.layout.block_bytes
        if self.tp_scratch is None or self.tp_scratch.numel() < need:
            self.tp_scratch = None
            self.tp_scratch = torch.ones(need, dtype=torch.uint8)  # every page touched before timing
        rows, packs = self._tp_posted(src, dst, chunks, self.tp_scratch.data_ptr())
        layout = agent.peer(self.tp_peers[dst]).info.layout
        dtype = getattr(torch, layout.dtype)
        t0 = time.perf_counter()
        for _, mine, local, offset in packs:  # as the pusher packs into its staging area
            n = len(local)
            view = self.tp_scratch[offset:offset + n * layout.block_bytes].view(dtype).view(
                n, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
            pack_blocks(mine, agent.rank_tensors, local, view)
        pack_s = time.perf_counter() - t0 if packs else None
        local, remote = np.ascontiguousarray(rows[:, :2]), np.ascontiguousarray(rows[:, 2:])
        t0 = time.perf_counter()
        _cma_write(self.peer_pid, local, remote)
        return {"pack": pack_s, "cma": time.perf_counter() - t0}

    def tp_memcpy(self, num_blocks: int) -> float:
        """Seconds of one libc memcpy of the reference pool's first `num_blocks` blocks (the
        model's whole KV of that many blocks) into a contiguous buffer."""
        src = self.tp_full_rows[:num_blocks]
        if self.scratch is None or self.scratch.shape != src.shape:
            self.scratch = np.ones(src.shape, dtype=np.uint64)  # every page touched before timing
        t0 = time.perf_counter()
        np.copyto(self.scratch, src)
        return time.perf_counter() - t0

    def tp_expected(self, heads: list[list[int]], blocks: list[int]) -> list[str]:
        """Per receiving rank (`heads`: [start, count] each), the digest its target blocks must
        have: the blocks' slice of those heads from the full-head reference, block by block."""
        full = self.tp_full.view(torch.int16)
        out = []
        for start, count in heads:
            h = hashlib.blake2b(digest_size=16)
            for b in blocks:
                h.update(full[b, ..., start:start + count, :].contiguous().numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def tp_teardown(self) -> None:
        for w in self.tp_workers.values():
            w.agent.close()
        self.tp_workers, self.tp_pushers, self.tp_peers = {}, {}, {}
        self.tp_full = self.tp_full_rows = self.scratch = self.tp_scratch = None
        gc.collect()

    def teardown(self) -> None:
        self.pusher = None
        self.tp_teardown()
        super().teardown()


class ReceiverSide(_Side):
    def __init__(self) -> None:
        super().__init__()
        self.receiver: KVReceiver | None = None
        self.events: dict[str, object] = {}
        self.tp_workers: dict[int, _Ranked] = {}  # degree -> worker
        self.tp_receivers: dict[int, KVReceiver] = {}

    def setup(self, name: str, layout: dict) -> dict:
        """Fresh agent; returns its transfer info and this process's pid (for the CMA reference)."""
        _, fresh = self._new_agent(name, layout)
        if fresh:
            self.rows.fill(POISON)
        self.receiver = KVReceiver(self.agent)
        self.events.clear()
        return {"info": self.agent.info().to_bytes(), "pid": os.getpid()}

    def expect(self, request_id: str, blocks: list[int], poison: bool, timeout_s: float) -> None:
        if poison:
            self.rows[np.asarray(blocks, dtype=np.intp)] = POISON
        self.receiver.expect(request_id, timeout_s=timeout_s)

    def wait(self, request_id: str, blocks: list[int], verify: bool, timeout_s: float) -> dict:
        """Poll until `request_id` ends here; with `verify`, digest its target blocks."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self.events:
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver: nothing for {request_id} within {timeout_s:.0f}s")
            self.poll()
            time.sleep(IDLE_POLL_S)
        ev = self.events.pop(request_id)
        return {"status": ev.status.value, "num_blocks": ev.num_blocks,
                "digest": _digest(self.rows, blocks) if verify else None}

    def tp_setup(self, names: dict[int, str], layout: dict) -> dict:
        """One poisoned worker per degree; returns each one's transfer info and ranks' heads."""
        self.tp_teardown()
        full = KVLayout(**layout)
        self.tp_workers = {d: _Ranked(name, full, d, None) for d, name in names.items()}
        self.tp_receivers = {d: KVReceiver(w.agent) for d, w in self.tp_workers.items()}
        self.events.clear()
        return {"infos": {d: w.agent.info().to_bytes() for d, w in self.tp_workers.items()}, "pid": os.getpid(),
                "heads": {d: [[h.start, len(h)] for h in w.heads] for d, w in self.tp_workers.items()}}

    def tp_expect(self, degree: int, request_id: str, blocks: list[int], poison: bool, timeout_s: float) -> None:
        if poison:
            for rows in self.tp_workers[degree].rows:
                rows[np.asarray(blocks, dtype=np.intp)] = POISON
        self.tp_receivers[degree].expect(request_id, timeout_s=timeout_s)

    def tp_wait(self, degree: int, request_id: str, blocks: list[int], verify: bool, timeout_s: float) -> dict:
        """`wait`, with one digest per rank of the degree-`degree` worker."""
        got = self.wait(request_id, blocks, False, timeout_s)
        got["digests"] = [_digest(rows, blocks) for rows in self.tp_workers[degree].rows] if verify else None
        return got

    def poll(self) -> None:
        for receiver in (self.receiver, *self.tp_receivers.values()):
            if receiver is not None:
                for ev in receiver.poll():
                    self.events[ev.request_id] = ev

    def tp_teardown(self) -> None:
        self.tp_receivers = {}
        for w in self.tp_workers.values():
            w.agent.close()
        self.tp_workers = {}
        gc.collect()

    def teardown(self) -> None:
        self.receiver = None
        self.tp_teardown()
        super().teardown()


def _serve(conn: Connection, side: _Side, idle: Callable[[], None] | None) -> None:
    """Answer commands until "stop"; between them call `idle` every IDLE_POLL_S (or just wait)."""
    torch.set_num_threads(1)  # CMA copies in one thread; so do the references
    import nixl_cu12._api  # noqa: F401  (sets up NIXL's logging, which we then quiet)

    logging.getLogger("nixl").setLevel(logging.WARNING)
    try:
        while True:
            if not conn.poll(IDLE_POLL_S if idle else 1.0):
                if idle:
                    idle()
                continue
            name, kwargs = conn.recv()  # EOFError when the coordinator is gone: exit
            if name == "stop":
                side.teardown()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(side, name)(**kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass


def sender_main(conn: Connection) -> None:
    _serve(conn, SenderSide(), None)


def receiver_main(conn: Connection) -> None:
    side = ReceiverSide()
    _serve(conn, side, side.poll)
