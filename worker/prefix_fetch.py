"""Cross-worker prefix fetch: a decode worker whose prefix cache lacks a prompt's leading
blocks that a sibling decode worker holds (the gateway's prefix index says so:
GenerateRequest.prefix_source) has the sibling push them over NIXL instead of computing
them, when the push is predicted to be the cheaper of the two.

`PrefixFetches` runs on the worker's loop thread, before the request is admitted: `start`
pins the blocks the pool already finds of the prompt, allocates blocks for the run the
sibling holds after them and asks the sibling (PrefillWorker.Prefill with `prefix_only`,
decode/kv_source.py) to push into them; once its reply and the KV notification are both
in, the pushed blocks are made findable under their hashes (engine/prefix_blocks.py), every
pin is released and the request's future resolves with what the pool now holds
(`Fetched`, which the request's first message repeats: pb.Served's prefix_source and
prefix_blocks). The request is then admitted as any other: its schedule finds those blocks
cached, so only the uncached tail is computed (or prefilled remotely).

A fetch that fails, is refused or passes its deadline resolves the future at once with
what the pool held before (the request computes the rest); its blocks are released only
once the sibling confirms nothing is in flight (the Abort RPC) or is known gone, the rule
every writer into this pool follows (decode/remote_prefill.py).

Cost: the fetch is skipped when the fetches this worker measured predict it slower than
computing those tokens at its measured prefill rate (worker/fetch_cost.py: a fixed part and
a part per block, and a probe now and then so a slow fetch does not turn fetching off for
good); until either is measured it is tried.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from common import trace
from common.block_hash import block_hashes
from engine import prefix_blocks as blocks_of
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2 as pb
from transfer import KVReceiver, ReceiveEvent, ReceiveStatus, TransferAgent
from worker import metrics
from worker.fetch_cost import FetchCost
from worker.peers import ABORT_RETRY_S, ABORT_TIMEOUT_S, KVPeers, abort_answered, new_transfer_id

log = logging.getLogger(__name__)

# A fetch may take at most this many times what computing its tokens would (at the worker's
# measured prefill rate), and at least MIN_FETCH_S (a round trip and the holder's next step):
# past it the request computes them, and the cost model learns the fetch was slow.
FETCH_SLACK = 2.0
MIN_FETCH_S = 1.0


@dataclass(frozen=True)
class Fetched:
    """What a fetch left in the pool: the prompt tokens it holds in a row now, and how many
    blocks of them came from `source` (0: the fetch failed or was refused)."""

    cached_tokens: int
    source: str
    blocks: int


class _Phase(enum.Enum):
    FETCHING = "fetching"
    ABORTING = "aborting"  # failed while the sibling may still write: waiting for its Abort answer


@dataclass
class _Fetch:
    request_id: str
    fetch_id: str  # what the sibling knows it by (its pull's id)
    transfer_id: str
    source: str
    hashes: list[bytes]  # of the blocks asked for, in order
    first: int  # blocks the pool found before them (pinned: `pinned`)
    pinned: list[int]
    blocks: list[int]  # allocated here for the sibling to fill, one per hash
    done: Future  # resolves to a Fetched
    deadline: float
    started: float = field(default_factory=time.monotonic)
    phase: _Phase = _Phase.FETCHING
    rpc: grpc.Future | None = None
    reply: pb.PrefillResponse | None = None
    kv_complete: bool = False
    abort_rpc: grpc.Future | None = None
    retry_at: float = 0.0


class PrefixFetches:
    """Every prefix fetch of one worker (its loop thread), by its transfer id. A completed
    fetch's blocks (those the pool found and those that came over) stay pinned for the
    request: the worker `claim`s them when it admits the request, and `release_claimed`
    lets them go once the request's first step has taken them itself (or it ended); pins
    nobody claimed within `hold_s` are released here."""

    def __init__(self, agent: TransferAgent, receiver: KVReceiver, peers: KVPeers, engine: LLMEngine,
                 prefill_tokens_per_s: Callable[[], float], hold_s: Callable[[], float]):
        self.agent, self.receiver, self.peers, self.engine = agent, receiver, peers, engine
        self.block_size = engine.block_size
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.hold_s = hold_s
        self.cost = FetchCost()  # measured over completed fetches (and those that ran out of time)
        self.fetches: dict[str, _Fetch] = {}
        self._held: dict[str, tuple[list[int], float]] = {}  # request id -> (pinned blocks, until)
        self._claimed: dict[str, list[int]] = {}  # request id -> pinned blocks, its request admitted
        self._transfer_info: bytes | None = None  # this agent's, once a fetch needs it

    def __len__(self) -> int:
        """Fetches in flight, and completed ones whose pins no request took yet."""
        return len(self.fetches) + len(self._held)

    def claim(self, request_id: str) -> None:
        """The request was admitted: its completed fetch's pins (if any) are kept until
        `release_claimed` finds its first step took the blocks."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._claimed[request_id] = held[0]

    def release_claimed(self, taken: Callable[[str], bool]) -> None:
        """Unpin the claimed blocks of every request for which `taken(request_id)` (its first
        step ran, or it ended)."""
        for request_id in [r for r in self._claimed if taken(r)]:
            blocks_of.unpin(self.engine, self._claimed.pop(request_id))

    # -- commands -------------------------------------------------------------------------

    def start(self, request_id: str, tokens: list[int], salt: str, source: pb.PrefixSource,
              deadline_s: float) -> Future | None:
        """Fetch the prompt's leading blocks `source` holds, past those this pool finds; None
        when there is nothing to fetch or it is not worth it (the request computes them)."""
        # At least one token is always computed (its logits): the last block is never fetched if full.
        usable = max(len(tokens) - 1, 0) // self.block_size
        hashes = block_hashes(tokens[:min(source.blocks, usable) * self.block_size], self.block_size, salt)
        local = blocks_of.held_run(self.engine, hashes)
        wanted = hashes[len(local):]
        if not wanted:
            return None
        rate = self.prefill_tokens_per_s()
        compute_s = len(wanted) * self.block_size / rate if rate > 0 else None
        if not self.cost.worth_it(len(wanted), compute_s):
            metrics.PREFIX_FETCHES.labels("skipped_cost").inc()
            trace.event(request_id, "prefix_fetch_skipped", why="cost", blocks=len(wanted))
            return None
        if self._transfer_info is None:
            self._transfer_info = self.agent.info().to_bytes()
        blocks_of.pin(self.engine, local)  # before the allocation, which could evict them
        blocks = blocks_of.allocate(self.engine, len(wanted))
        if blocks is None:
            blocks_of.unpin(self.engine, local)
            metrics.PREFIX_FETCHES.labels("skipped_room").inc()
            trace.event(request_id, "prefix_fetch_skipped", why="room", blocks=len(wanted))
            return None
        if compute_s is not None:  # no longer than computing them would take, with slack
            deadline_s = min(deadline_s, max(MIN_FETCH_S, FETCH_SLACK * compute_s))
        transfer_id = new_transfer_id(f"{request_id}-prefix", 0)
        # The holder knows the pull by its transfer id: unique, so a late Abort of one fetch
        # never refuses a later fetch for the same request (a replay's).
        f = _Fetch(request_id, transfer_id, transfer_id, source.address, wanted, len(local), local,
                   blocks, Future(), time.monotonic() + deadline_s)
        req = pb.PrefillRequest(
            request_id=f.fetch_id, prompt_token_ids=tokens[:(f.first + len(wanted)) * self.block_size],
            cache_salt=salt, transfer_id=f.transfer_id, prefix_only=True,
            destination=pb.KVDestination(agent_name=self.agent.name, block_ids=blocks,
                                         num_cached_tokens=f.first * self.block_size),
            decode_transfer_info=self._transfer_info)
        self.fetches[f.transfer_id] = f
        trace.event(request_id, "prefix_fetch_sent", source=source.address, blocks=len(wanted), cached_blocks=f.first)
        try:
            f.rpc = self.peers.stub(source.address).Prefill.future(req, timeout=deadline_s)
        except Exception as e:  # nothing went out: nobody writes these blocks
            del self.fetches[f.transfer_id]
            self._release(f)
            self._resolve(f, "failed", f"{type(e).__name__}: {e}")
            return f.done
        self.receiver.expect(f.transfer_id, timeout_s=deadline_s + 1.0)
        log.info("request %s: fetching %d prefix blocks from %s (%d cached here)", request_id, len(wanted),
                 source.address, f.first)
        return f.done

    def abort_all(self) -> None:
        """The worker shuts down: every fetch fails (blocks freed once nothing is in flight)."""
        for f in list(self.fetches.values()):
            if f.phase is _Phase.FETCHING:
                self._failed(f, "the worker is shutting down")
        for blocks in [b for b, _ in self._held.values()] + list(self._claimed.values()):
            blocks_of.unpin(self.engine, blocks)
        self._held.clear()
        self._claimed.clear()

    # -- events ---------------------------------------------------------------------------

    def on_receive(self, ev: ReceiveEvent) -> bool:
        """A KV notification; False when it is none of a fetch's."""
        f = self.fetches.get(ev.request_id)
        if f is None or f.phase is not _Phase.FETCHING:
            return False
        if ev.status is ReceiveStatus.COMPLETE:
            f.kv_complete = True
            self._maybe_done(f)
        else:
            self._failed(f, f"KV {ev.status.value}", slow=ev.status is ReceiveStatus.TIMED_OUT)
        return True

    def poll(self) -> None:
        now = time.monotonic()
        for f in list(self.fetches.values()):
            if f.phase is _Phase.ABORTING:
                if f.abort_rpc is not None and f.abort_rpc.done():
                    rpc, f.abort_rpc = f.abort_rpc, None
                    if abort_answered(rpc, f.fetch_id, f.source, self.peers):
                        self._forget(f)
                    else:
                        f.retry_at = now + ABORT_RETRY_S
                elif f.abort_rpc is None and (now >= f.retry_at or self.peers.gone(f.source)):
                    if self.peers.gone(f.source):
                        self._forget(f)
                    else:
                        f.abort_rpc = self._ask_abort(f)
                continue
            if f.rpc is not None and f.rpc.done():
                rpc, f.rpc = f.rpc, None
                try:
                    resp = rpc.result()
                except grpc.RpcError as e:
                    self._failed(f, f"{e.code().name}: {e.details()}", may_write=not self.peers.gone(f.source, e))
                    continue
                if resp.error.code != pb.ERROR_NONE:  # it answered: nothing of it in flight
                    outcome = "evicted" if resp.error.code == pb.KV_NOT_HELD else "failed"
                    self._failed(f, resp.error.message, may_write=False, outcome=outcome)
                    continue
                f.reply = resp
                self._maybe_done(f)
            elif now >= f.deadline:
                self._failed(f, "deadline", slow=True)
        for request_id, (blocks, until) in list(self._held.items()):
            if now >= until:  # its request never came to take them (refused, or its caller gave up)
                del self._held[request_id]
                blocks_of.unpin(self.engine, blocks)

    # -- inside ---------------------------------------------------------------------------

    def _maybe_done(self, f: _Fetch) -> None:
        if f.reply is None or not f.kv_complete:
            return
        asked = len(f.blocks)
        pushed = max(0, min(asked, f.reply.num_cached_tokens // self.block_size - f.first))
        found = blocks_of.adopt(self.engine, f.blocks[:pushed], f.hashes[:pushed])
        del self.fetches[f.transfer_id]
        # Pinned for the request until its first step takes them: an allocation before then
        # (another request's step) must not evict what just came over.
        self._held[f.request_id] = (f.pinned + f.blocks[:pushed], time.monotonic() + self.hold_s())
        blocks_of.unpin(self.engine, f.blocks[pushed:])  # never written
        f.pinned, f.blocks = [], []
        seconds = time.monotonic() - f.started
        if pushed:
            self.cost.observe(pushed, seconds)
            metrics.PREFIX_TIER_TOKENS.labels("sibling").inc(found * self.block_size)
        outcome = "fetched" if pushed == asked else "partial"
        self._resolve(f, outcome, f"{pushed} of {asked} blocks in {seconds:.3f}s", pushed=pushed)

    def _failed(self, f: _Fetch, reason: str, may_write: bool = True, outcome: str = "failed",
                slow: bool = False) -> None:
        """`slow`: it ran out of time, which the cost model counts as what it cost."""
        if slow:
            self.cost.observe(len(f.hashes), time.monotonic() - f.started)
        self.receiver.forget(f.transfer_id)
        if f.rpc is not None:
            f.rpc.cancel()
            f.rpc = None
        self._resolve(f, outcome, reason)
        if may_write and not self.peers.gone(f.source):
            f.phase = _Phase.ABORTING
            f.abort_rpc = self._ask_abort(f)
        else:
            self._forget(f)

    def _forget(self, f: _Fetch) -> None:
        """Nothing of the fetch is in flight any more: its blocks are free again."""
        self.fetches.pop(f.transfer_id, None)
        self._release(f)

    def _release(self, f: _Fetch) -> None:
        blocks_of.unpin(self.engine, f.blocks)  # those made findable stay cached (ref 0, the LRU's tail)
        blocks_of.unpin(self.engine, f.pinned)
        f.blocks, f.pinned = [], []

    def _resolve(self, f: _Fetch, outcome: str, detail: str, pushed: int = 0) -> None:
        if f.done.done():
            return
        metrics.PREFIX_FETCHES.labels(outcome).inc()
        trace.event(f.request_id, "prefix_fetched", outcome=outcome, source=f.source, blocks=pushed, detail=detail)
        log.info("request %s: prefix fetch from %s %s: %s", f.request_id, f.source, outcome, detail)
        f.done.set_result(Fetched((f.first + pushed) * self.block_size, f.source, pushed))

    def _ask_abort(self, f: _Fetch) -> grpc.Future:
        return self.peers.stub(f.source).Abort.future(pb.AbortRequest(request_id=f.fetch_id), timeout=ABORT_TIMEOUT_S)
