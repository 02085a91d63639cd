"""A drained decode worker's running requests, kept for the decode workers that take them over.

A drain that hands off (deploy/drain.py) ends each request here with HANDED_OFF. One that
sits between two decode steps, its KV complete but for its last sampled token, keeps its
blocks (`keep`, LLMEngine.keep): its gateway replays it on another decode worker naming
this one as its KV source (GenerateRequest.kv_source, gateway/decode_stream.py). That
worker reserves blocks as for a remote prefill and asks this one, through the
PrefillWorker service's Prefill with `kv_request_id` set, to fill them (`pull`): the kept
blocks are pushed over NIXL as they are, nothing is computed, and the reply's first token
is the request's last one, which the taker decodes next. Abort works as on a prefill
worker (`abort`: confirmed once nothing is in flight). Kept blocks nobody pulls within
`hold_s` are released; a drain waits for them (they are held blocks: worker/holdings.py).

It also pushes a prompt's leading blocks from this worker's prefix cache to a sibling that
fetches them instead of computing them (`pull_prefix`, worker/prefix_fetch.py): the worker
pins the blocks, this pushes them and unpins them through the worker's callback once the
push ends, however it ends.

Commands in, `poll() -> list[str]` (request ids whose kept blocks the engine may release)
out, the shape of decode/remote_prefill.py; it never touches the engine itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from common import trace
from decode import metrics
from engine.sequence import KeptKV
from rpc import pdserve_pb2 as pb
from transfer import KVPusher, PushStatus, TransferAgent
from worker.destination import checked_destination
from worker.push_calls import EarlyAborts

log = logging.getLogger(__name__)


class NotHeld(ValueError):
    """A prefix pull for blocks this worker's prefix cache no longer holds (evicted since the
    gateway's index said so): the taker computes them."""


@dataclass
class _Kept:
    kv: KeptKV
    expires: float  # monotonic
    pulled_by: str = ""  # the taker's request id while its pull runs


@dataclass
class _Pull:
    request_id: str  # the taker's
    kept: _Kept | None  # None: a prefix pull (its blocks pinned in the pool until `unpin`)
    reply: Future  # resolves to a PrefillResponse
    num_cached_tokens: int
    started: float = field(default_factory=time.monotonic)
    abort_waiters: list[Future] = field(default_factory=list)
    unpin: Callable[[], None] | None = None
    num_blocks: int = 0  # a prefix pull's


class KVSource:
    """Every kept request of one decode worker (its loop thread), by the id it had here."""

    def __init__(self, agent: TransferAgent, block_size: int):
        self.agent = agent
        self.block_size = block_size
        self.pusher = KVPusher(agent)
        self.kept: dict[str, _Kept] = {}
        self.pulls: dict[str, _Pull] = {}  # by the taker's request id
        self._early_aborts = EarlyAborts()
        self._released: list[str] = []
        self._prefix_pulls = 0  # pulls with kept None in `pulls` (the loop thread changes it)

    def __len__(self) -> int:
        """Kept requests, prefix pulls in flight and released requests the engine has not
        been told of yet (`poll`) (any thread: counts, no iteration)."""
        return len(self.kept) + self._prefix_pulls + len(self._released)

    def keep(self, kv: KeptKV, hold_s: float) -> None:
        """Hold `kv` for a taker's pull, at most `hold_s` seconds."""
        self.kept[kv.request_id] = _Kept(kv, time.monotonic() + hold_s)
        metrics.MIGRATIONS.labels("kept").inc()
        trace.event(kv.request_id, "kv_kept", tokens=len(kv.token_ids), blocks=len(kv.block_ids))

    def pull(self, req: pb.PrefillRequest, reply: Future, timeout_s: float | None) -> None:
        """Push the kept KV of `req.kv_request_id` into the blocks `req` names; `reply` gets
        the PrefillResponse once the push ended. ValueError (nothing started) when it is not
        kept here, is pulled already, or the request or its destination does not match."""
        rid, kept_id = req.request_id, req.kv_request_id
        if self._early_aborts.take(rid):
            raise ValueError(f"request {rid}: aborted before its pull arrived")
        kept = self.kept.get(kept_id)
        if kept is None:
            metrics.MIGRATIONS.labels("refused").inc()
            raise ValueError(f"request {rid}: the KV of {kept_id} is not kept here (never was, pulled, or expired)")
        if kept.pulled_by or rid in self.pulls:
            raise ValueError(f"request {rid}: the KV of {kept_id} is being pulled already ({kept.pulled_by})")
        if list(req.prompt_token_ids) != kept.kv.token_ids:
            metrics.MIGRATIONS.labels("refused").inc()
            raise ValueError(f"request {rid}: its {len(req.prompt_token_ids)} tokens are not the "
                             f"{len(kept.kv.token_ids)} whose KV {kept_id} keeps here")
        info = checked_destination(rid, req, len(kept.kv.token_ids), self.block_size, None)
        peer = self.agent.add_peer(info)
        skip = req.destination.num_cached_tokens // self.block_size
        self.pusher.start(rid, peer, timeout_s, notify_as=req.transfer_id)
        kept.pulled_by = rid
        self.pulls[rid] = _Pull(rid, kept, reply, req.destination.num_cached_tokens)
        self.pusher.push(rid, kept.kv.block_ids[skip:], list(req.destination.block_ids), last=True)
        trace.event(kept_id, "kv_pull", taker=peer, as_id=rid, blocks=len(req.destination.block_ids))
        log.info("request %s: pushing its kept KV (%d blocks) to %s as %s", kept_id, len(req.destination.block_ids),
                 peer, rid)

    def pull_prefix(self, req: pb.PrefillRequest, blocks: list[int], reply: Future, timeout_s: float | None,
                    unpin: Callable[[], None]) -> None:
        """Push `blocks` (this pool's blocks of the prompt's leading run after the taker's
        cached ones, pinned by the caller) into the first of the blocks `req` names, for a
        sibling that fetches a prefix instead of computing it (worker/prefix_fetch.py);
        `unpin` runs once the push ended, however it ended. ValueError (nothing started, the
        caller unpins) when the request or its destination does not check out."""
        rid = req.request_id
        if self._early_aborts.take(rid):
            raise ValueError(f"request {rid}: aborted before its pull arrived")
        if rid in self.pulls:
            raise ValueError(f"request {rid}: duplicate request id (one with this id is still in flight)")
        info = checked_destination(rid, req, len(req.prompt_token_ids), self.block_size, None)
        peer = self.agent.add_peer(info)
        self.pusher.start(rid, peer, timeout_s, notify_as=req.transfer_id)
        cached_to = req.destination.num_cached_tokens + len(blocks) * self.block_size
        self.pulls[rid] = _Pull(rid, None, reply, cached_to, unpin=unpin, num_blocks=len(blocks))
        self._prefix_pulls += 1
        self.pusher.push(rid, blocks, list(req.destination.block_ids[:len(blocks)]), last=True)
        trace.event(rid, "prefix_pull", taker=peer, blocks=len(blocks))
        log.info("request %s: pushing %d prefix blocks to %s", rid, len(blocks), peer)

    def abort(self, request_id: str, confirmed: Future | None = None) -> None:
        """Stop the pull of the taker's `request_id`; `confirmed` resolves (True if it was
        known) once nothing of it is in flight. One not here yet is refused when it comes.
        `request_id` may also be a kept request's own id, not being pulled: its gateway gave
        its hand-off up (no decode worker took it), and its blocks are released now instead
        of at the end of their hold."""
        p = self.pulls.get(request_id)
        kept = self.kept.get(request_id)
        if p is None and kept is not None and not kept.pulled_by:
            log.info("request %s: its gateway gave its hand-off up; kept KV released", request_id)
            self._release(kept, "abandoned")
            if confirmed is not None:
                confirmed.set_result(True)
            return
        if p is None:
            return self._early_aborts.not_here(request_id, confirmed)
        if confirmed is not None:
            p.abort_waiters.append(confirmed)
        self.pusher.abort(request_id)

    def drop_all(self) -> None:
        """The worker shuts down: pulls are aborted (answered once nothing is in flight),
        kept KV nobody pulls yet is released at the next poll."""
        for request_id in list(self.pulls):
            self.pusher.abort(request_id)
        for kept in self.kept.values():
            if not kept.pulled_by:
                kept.expires = 0.0

    def poll(self) -> list[str]:
        """Pushes that ended answer their pulls; returns the kept requests whose blocks are
        free to release (pulled, failed, aborted, or unclaimed past their hold)."""
        for ev in self.pusher.poll():
            p = self.pulls.pop(ev.request_id, None)
            if p is None:
                continue
            if p.kept is not None:
                self._release(p.kept, ev.status.value)
            else:
                p.unpin()
                self._prefix_pulls -= 1
                if ev.status is PushStatus.DONE:
                    metrics.PREFIX_SERVED.inc(p.num_blocks)
            if ev.status is PushStatus.DONE:
                p.reply.set_result(pb.PrefillResponse(
                    first_token_id=p.kept.kv.last_token if p.kept is not None else 0,
                    num_cached_tokens=p.num_cached_tokens, timings=pb.Timings(transfer_s=time.monotonic() - p.started)))
                if p.kept is not None:
                    log.info("request %s: kept KV pushed to its taker (%s) in %.3fs", p.kept.kv.request_id,
                             p.request_id, ev.seconds)
                else:
                    log.info("request %s: prefix blocks pushed to its taker in %.3fs", p.request_id, ev.seconds)
            else:
                code = pb.CANCELLED if ev.status is PushStatus.ABORTED else pb.KV_TRANSFER_FAILED
                p.reply.set_result(pb.PrefillResponse(error=pb.Error(
                    code=code, message=f"KV push: {ev.reason or ev.status.value}", request_id=p.request_id)))
            for waiter in p.abort_waiters:
                waiter.set_result(True)
        now = time.monotonic()
        for kept in list(self.kept.values()):
            if not kept.pulled_by and now >= kept.expires:
                log.info("request %s: its kept KV was not pulled in time; released", kept.kv.request_id)
                self._release(kept, "expired")
        released, self._released = self._released, []
        return released

    def _release(self, kept: _Kept, outcome: str) -> None:
        del self.kept[kept.kv.request_id]
        self._released.append(kept.kv.request_id)
        metrics.MIGRATIONS.labels("pushed" if outcome == PushStatus.DONE.value else outcome).inc()
        trace.event(kept.kv.request_id, "kv_released", outcome=outcome)
