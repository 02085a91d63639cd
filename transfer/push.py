"""Sender side: push a request's KV blocks into a peer's blocks, chunk by chunk.

    pusher.start("req-1", peer="decode-0-3", timeout_s=30)
    pusher.push("req-1", local_blocks=[4, 9], remote_blocks=[17, 2])          # after chunk 1
    pusher.push("req-1", local_blocks=[12], remote_blocks=[30], last=True)   # after the last chunk
    for event in pusher.poll(): ...                                         # every engine step

Every call returns at once; outcomes come back from `poll()` as `PushEvent`s (done,
failed with the blocks that are not confirmed, aborted), never as exceptions across the
loop. The last chunk carries the `done` notification and is posted only after every
earlier chunk completed, so the receiver's notification means all of the request's
blocks have landed. `abort()` stops posting; the `ABORTED` event (and the receiver's
`abort` notification) come once nothing of the request is in flight. A dead peer
surfaces as an error from NIXL on the next post or poll, a stuck one at the timeout.
Injected faults (transfer/faults.py) delay or fail posts the same way.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer import metrics
from transfer.agent import MAX_PEERS, TransferAgent
from transfer.faults import FaultFile, InjectedTransferError
from transfer.handshake import parse_agent_name
from transfer.layout import region_indices
from transfer.messages import NotifKind, encode
from transfer.ranks import Piece, block_descriptors, pack_blocks, write_pieces

log = logging.getLogger(__name__)


class PushStatus(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class PushEvent:
    request_id: str
    status: PushStatus
    peer: str
    remote_blocks: tuple[int, ...] = ()  # FAILED: blocks whose write is not confirmed
    reason: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Chunk:
    local: list[int]
    remote: list[int]
    last: bool
    queued_at: float = field(default_factory=time.monotonic)
    handle: object = None  # NIXL transfer handle once posted
    num_bytes: int = 0  # what its write moves, once posted
    staged: list[int] = field(default_factory=list)  # its packed blocks' offsets in the agent's staging


@dataclass
class _Push:
    request_id: str
    peer: str
    deadline: float
    started: float
    notify_id: str  # what the notifications carry
    queued: deque[_Chunk] = field(default_factory=deque)
    in_flight: list[_Chunk] = field(default_factory=list)
    confirmed_bytes: int = 0
    num_blocks: int = 0
    saw_last: bool = False
    aborting: bool = False
    failed: str = ""  # why it failed; its FAILED waits until no write of it can still land
    unconfirmed: tuple[int, ...] = ()


class KVPusher:
    def __init__(self, agent: TransferAgent, default_timeout_s: float = 30.0):
        self.agent = agent
        self.default_timeout_s = default_timeout_s
        self._pushes: dict[str, _Push] = {}
        self._events: list[PushEvent] = []
        self._faults = FaultFile(agent.name)
        self._pieces_by_peer: dict[str, list[Piece]] = {}

    def start(self, request_id: str, peer: str, timeout_s: float | None = None, notify_as: str = "") -> None:
        """Open a push of one request's KV into `peer` (an agent name added with add_peer);
        its notifications name `notify_as` (the receiver's transfer id), else the request id."""
        if request_id in self._pushes:
            raise ValueError(f"request {request_id}: a push is already open")
        self.agent.peer(peer)  # raises UnknownPeerError before anything starts
        now = time.monotonic()
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        self._pushes[request_id] = _Push(request_id, peer, now + timeout, now, notify_as or request_id)
        metrics.IN_FLIGHT.inc()

    def push(self, request_id: str, local_blocks: list[int], remote_blocks: list[int], last: bool = False) -> None:
        """Queue a chunk: local block i is written into the peer's block remote_blocks[i]."""
        p = self._pushes.get(request_id)
        if p is None or p.aborting or p.failed:
            return  # finished, failed or aborted: its event was or will be reported
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"request {request_id}: {len(local_blocks)} local vs {len(remote_blocks)} remote blocks")
        if p.saw_last:
            raise ValueError(f"request {request_id}: chunk after the last one")
        p.saw_last = last
        p.num_blocks += len(local_blocks)
        p.queued.append(_Chunk(list(local_blocks), list(remote_blocks), last))
        self._advance(p)

    def abort(self, request_id: str) -> None:
        """Stop posting; ABORTED is reported by poll() once no write of the request is in flight."""
        p = self._pushes.get(request_id)
        if p is not None and not p.failed:  # a failing one reports FAILED once its writes end
            p.aborting = True
            p.queued.clear()
            self._advance(p)

    def poll(self) -> list[PushEvent]:
        """Check in-flight writes, post what can go, enforce timeouts; return finished pushes."""
        now = time.monotonic()
        for p in list(self._pushes.values()):
            if p.failed:
                self._drain_failed(p)
                continue
            self._advance(p)
            if p.request_id in self._pushes and not p.failed and now > p.deadline:
                self._fail(p, "timeout")
        events, self._events = self._events, []
        return events

    @property
    def num_active(self) -> int:
        return len(self._pushes)

    def _advance(self, p: _Push) -> None:
        try:
            for chunk in list(p.in_flight):
                state = self.agent.nixl.check_xfer_state(chunk.handle)
                if state == "DONE":
                    p.in_flight.remove(chunk)
                    chunk.handle.release()
                    self._unstage(chunk)
                    p.confirmed_bytes += chunk.num_bytes
                    if chunk.last:
                        return self._finish(p, PushStatus.DONE)
                elif state == "ERR":
                    return self._fail(p, "transfer error")
            if p.aborting:
                if not p.in_flight:
                    self._notify_abort(p)
                    self._finish(p, PushStatus.ABORTED)
                return
            fault = self._faults.current()
            while p.queued:
                chunk = p.queued[0]
                if chunk.last and p.in_flight:
                    return  # the notification must follow every earlier write
                if fault is not None:
                    if time.monotonic() < chunk.queued_at + fault.delay_s:
                        return  # a slow (or, with an infinite delay, stuck) link
                    if random.random() < fault.error_rate:
                        raise InjectedTransferError(f"injected fault ({self._faults.path})")
                if not chunk.local:  # nothing to write; a last one still owes the notification
                    p.queued.popleft()
                    if chunk.last:
                        self.agent.send_notification(p.peer, encode(NotifKind.DONE, p.notify_id, p.num_blocks))
                        return self._finish(p, PushStatus.DONE)
                    continue
                if not self._post(p, chunk):
                    return  # the staging area is full: it posts once earlier writes end
                p.queued.popleft()
                p.in_flight.append(chunk)
        except Exception as e:  # NIXL raises e.g. nixlRemoteDisconnectError for a dead peer
            self._fail(p, f"{type(e).__name__}: {e}")

    def _post(self, p: _Push, chunk: _Chunk) -> bool:
        """Post the chunk's write; False (nothing posted) while the staging area is full."""
        agent = self.agent
        peer = agent.peer(p.peer)
        notif = encode(NotifKind.DONE, p.notify_id, p.num_blocks) if chunk.last else b""
        if agent.ranks or peer.info.ranks:  # a tensor-parallel side: every rank's share, in one write
            rows = self._rank_rows(peer, chunk)
            if rows is None:
                return False
            local, remote = rows
            handle = agent.nixl.initialize_xfer("WRITE", agent.nixl.get_xfer_descs(local, agent.mem_type),
                                                agent.nixl.get_xfer_descs(remote, peer.info.mem_type), p.peer, notif)
            chunk.num_bytes = int(local[:, 1].sum())
        else:
            r = agent.layout.regions_per_block
            handle = agent.nixl.make_prepped_xfer("WRITE", agent.local_dlist, region_indices(chunk.local, r),
                                                  peer.dlist, region_indices(chunk.remote, r), notif)
            chunk.num_bytes = len(chunk.local) * agent.layout.block_bytes
        chunk.handle = handle
        state = agent.nixl.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL refused to post the write")
        return True

    def _rank_rows(self, peer, chunk: _Chunk) -> tuple[np.ndarray, np.ndarray] | None:
        """The write's regions between tensor-parallel sides: whole blocks where a rank of
        theirs holds exactly one of ours' heads; the other ranks' heads packed into whole
        blocks in the staging area (None while it is full); per-row regions for a chunk too
        large to stage at all."""
        agent, theirs = self.agent, peer.info.side
        pieces = self._pieces(peer)
        packed = sorted({q.dst_rank for q in pieces if not q.whole})
        rows = [block_descriptors([q for q in pieces if q.whole], agent.side, theirs, chunk.local, chunk.remote,
                                  agent.device_id, peer.info.device_id)] if len(packed) < len(theirs.ranks) else []
        block_bytes = theirs.layout.block_bytes
        staging = agent.staging() if packed else None
        if packed and len(packed) * len(chunk.local) * block_bytes > staging.capacity:
            # more than the whole staging area at once (a whole request moved between decode
            # workers, say): regions per row, slow but sure, rather than wait for room never there
            mine = [q for q in pieces if not q.whole]
            rows.append(block_descriptors(mine, agent.side, theirs, chunk.local, chunk.remote,
                                          agent.device_id, peer.info.device_id))
            packed = []
        for d in packed:
            at = staging.take(len(chunk.local) * block_bytes)
            if at is None:
                self._unstage(chunk)
                return None
            chunk.staged.append(at)
            layout = theirs.layout
            view = staging.view(at, (len(chunk.local), layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                                     layout.head_dim), getattr(torch, layout.dtype))
            pack_blocks([q for q in pieces if q.dst_rank == d], agent.rank_tensors, chunk.local, view)
            n = len(chunk.local)
            src = staging.base_addr + at + np.arange(n, dtype=np.int64) * block_bytes
            dst = theirs.ranks[d].base_addr + np.asarray(chunk.remote, dtype=np.int64) * block_bytes
            size = np.full(n, block_bytes, dtype=np.int64)
            rows.append((np.stack([src, size, np.full(n, agent.device_id, dtype=np.int64)], axis=1),
                         np.stack([dst, size, np.full(n, peer.info.device_id, dtype=np.int64)], axis=1)))
        if packed and staging.buffer.is_cuda:  # the copies are queued on the device: done before NIXL reads
            torch.cuda.current_stream(staging.buffer.device).synchronize()
        return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])

    def _unstage(self, chunk: _Chunk) -> None:
        """Give back the chunk's packed blocks (its write ended, or never went out)."""
        for at in chunk.staged:
            self.agent.staging().give_back(at)
        chunk.staged.clear()

    def _pieces(self, peer) -> list[Piece]:
        """Which of our ranks' heads go to which of the peer's ranks (kept per peer)."""
        pieces = self._pieces_by_peer.get(peer.name)
        if pieces is None:
            if len(self._pieces_by_peer) >= 4 * MAX_PEERS:
                self._pieces_by_peer.clear()
            pieces = self._pieces_by_peer[peer.name] = write_pieces(self.agent.side, peer.info.side)
        return pieces

    def _notify_abort(self, p: _Push) -> None:
        try:
            self.agent.send_notification(p.peer, encode(NotifKind.ABORT, p.notify_id))
        except Exception as e:  # the receiver may be gone; the abort stands either way
            log.info("request %s: could not tell %s about the abort: %s", p.request_id, p.peer, e)

    def _fail(self, p: _Push, reason: str) -> None:
        """Stop posting and cancel what is in flight. FAILED (after which the receiver's
        blocks are reused) is reported only once no write of the push can still land:
        NIXL's release() of a write in progress cancels it, or raises if it cannot, and
        then the write is watched until it ends (_drain_failed)."""
        p.failed, p.unconfirmed = reason, tuple(b for c in (*p.in_flight, *p.queued) for b in c.remote)
        for chunk in p.queued:  # never posted, or its post raised: nothing of it is in flight
            if chunk.handle is not None:
                try:
                    chunk.handle.release()
                except Exception:
                    pass
            self._unstage(chunk)
        p.queued.clear()
        log.info("request %s: KV push to %s failed (%s); %d blocks unconfirmed",
                 p.request_id, p.peer, reason, len(p.unconfirmed))
        metrics.FAILURES.labels(reason=reason.split(":")[0].replace(" ", "_")).inc()
        self._drain_failed(p)

    def _drain_failed(self, p: _Push) -> None:
        for chunk in list(p.in_flight):
            try:
                chunk.handle.release()  # cancels a write still in progress, or raises
            except Exception:
                try:
                    state = self.agent.nixl.check_xfer_state(chunk.handle)
                except Exception:  # its peer is gone (a disconnect error): nothing more can land
                    state = "ERR"
                if state == "PROC":
                    continue  # it may still land: wait for it
                try:
                    chunk.handle.release()
                except Exception:
                    pass
            p.in_flight.remove(chunk)
            self._unstage(chunk)  # nothing of it can land any more: its packed blocks are free
        if not p.in_flight:
            self._finish(p, PushStatus.FAILED, p.unconfirmed, p.failed)

    def _finish(self, p: _Push, status: PushStatus, unconfirmed: tuple[int, ...] = (), reason: str = "") -> None:
        del self._pushes[p.request_id]
        metrics.IN_FLIGHT.dec()
        seconds = time.monotonic() - p.started
        if status is PushStatus.DONE:
            metrics.SECONDS.observe(seconds)
        metrics.BYTES.labels(peer_role=parse_agent_name(p.peer)[0]).inc(p.confirmed_bytes)
        self._events.append(PushEvent(p.request_id, status, p.peer, unconfirmed, reason, p.confirmed_bytes, seconds))
