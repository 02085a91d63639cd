"""The prefill worker: chunked prefill of prompts and a push of each finished chunk's KV
blocks into the blocks a decode worker reserved (docs/design.md steps 6-7).

Runs on its EngineLoop thread. The engine's scheduler does the chunking (token budget per
step, several prompts per forward, priorities, its own prefix cache); after every step
the blocks that became complete are pushed while the next chunk computes, and the last
push carries the notification. A request keeps its blocks only until its push ends (they
stay in the prefix cache afterwards); the Prefill reply (first token, timings) is sent
then. Abort stops the request and is confirmed once no write is in flight. Prompt blocks
the asking decode worker holds cached and this worker's own cache lacks (a conversation's
earlier answer, decoded there) are first fetched from it over NIXL instead of computed
(prefill/service.py, worker/prefix_fetch.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from common import trace
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine, StepResult
from rpc import pdserve_pb2 as pb
from rpc.convert import logprobs_to_pb
from transfer import KVPusher, KVReceiver, PushStatus, TransferAgent
from worker import metrics as worker_metrics
from worker.destination import checked_destination
from worker.holdings import Holdings
from worker.liveness import DEFAULT_STALL_FLOOR_S
from worker.loop import EngineLoop, ShuttingDown
from worker.peers import KVPeers
from worker.prefix_fetch import PrefixFetches
from worker.push_calls import EarlyAborts

log = logging.getLogger(__name__)

# After a step posts requests' last KV chunks, poll their pushes for up to this long before
# the next step starts: a push left in flight is seen done (and its reply sent) only after
# that whole step, while it completes within a few ms (once the decode worker's NIXL makes
# progress, which it does between layers of its own step).
_LAST_PUSH_WAIT_S = 0.005


@dataclass
class _Prefill:
    request_id: str
    peer: str
    dest_blocks: list[int]
    skip_blocks: int  # leading prompt blocks the decode worker already has cached
    num_prompt_tokens: int
    reply: Future  # resolves to a PrefillResponse
    arrived: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    sampled_at: float | None = None
    pushed: int = 0  # prompt blocks handed to the pusher so far (counting skipped ones)
    first_token: int | None = None
    first_logprobs: object = None
    num_cached_tokens: int = 0
    abort_waiters: list[Future] = field(default_factory=list)


class PrefillWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, agent: TransferAgent, push_timeout_s: float = 60.0,
                 stall_floor_s: float = DEFAULT_STALL_FLOOR_S):
        super().__init__(engine, name=f"{agent.name}-loop", stall_floor_s=stall_floor_s)
        self.name = agent.name
        self.agent = agent
        self.pusher = KVPusher(agent, default_timeout_s=push_timeout_s)
        self.block_size = engine.block_size
        self.requests: dict[str, _Prefill] = {}
        self.kv_blocks_transferred = 0
        # The deployment's decode agents (SetPeers, from the controller); None until the
        # first list arrives: a worker started by hand takes any destination that checks out.
        self.members: frozenset[str] | None = None
        self._early_aborts = EarlyAborts()
        # Prompt blocks the asking decode worker holds and this pool lacks, fetched from it
        # instead of computed (worker/prefix_fetch.py; Prefill's kv_holder).
        self.fetches = PrefixFetches(agent, KVReceiver(agent), KVPeers(), engine,
                                     lambda: self.liveness.prefill_tokens_per_s, self.loop_wait_s)

    def set_members(self, decode_agents: list[str], workers: list[str] = ()) -> None:
        """The controller's list of decode agents (any thread: one assignment); connections
        to agents that left are dropped on the loop, once nothing is in flight to them.
        `workers`: the deployment's worker addresses, the only ones a prefix is fetched from
        (one that left is known gone: a fetch waiting for its abort answer waits no more)."""
        self.members = frozenset(decode_agents)
        if workers:
            self.fetches.peers.set_members(list(workers))
        self.submit(self.drop_departed_peers)

    # -- commands (run on the loop thread) -----------------------------------------------

    def add(self, req: pb.PrefillRequest, params: SamplingParams, reply: Future,
            timeout_s: float | None) -> None:
        """Queue a prefill; failures before anything started resolve `reply` with an error."""
        rid = req.request_id
        if self.closing:
            raise ShuttingDown(f"request {rid}: {self.name} is shutting down")
        if self._early_aborts.take(rid):
            raise ValueError(f"request {rid}: aborted before its Prefill arrived; its blocks may be in use again")
        if req.kv_request_id:
            raise ValueError(f"request {rid}: asks for the kept KV of {req.kv_request_id}; a prefill worker keeps none")
        self.engine.check_token_ids(rid, list(req.prompt_token_ids), params)
        if rid in self.requests:  # e.g. its push is still in flight; its blocks are held under this id
            raise ValueError(f"request {rid}: duplicate request id (one with this id is still in flight)")
        info = checked_destination(rid, req, len(req.prompt_token_ids), self.block_size, self.members)
        dest = req.destination
        prompt = list(req.prompt_token_ids)
        num_blocks = -(-len(prompt) // self.block_size)
        skip = dest.num_cached_tokens // self.block_size
        peer = self.agent.add_peer(info)
        # The first token is sampled here with the request's own parameters; decoding goes on there.
        self.engine.add_request(rid, prompt, replace(params, max_tokens=1), req.priority, hold_blocks=True,
                                cache_salt=req.cache_salt)
        self.pusher.start(rid, peer, timeout_s, notify_as=req.transfer_id)
        self.fetches.claim(rid)  # its fetched prefix stays pinned until its first chunk runs
        self.requests[rid] = _Prefill(rid, peer, list(dest.block_ids), skip, len(prompt), reply, pushed=skip)
        trace.event(rid, "arrived", prompt_tokens=len(prompt), decode_agent=peer, blocks=num_blocks - skip)
        log.info("request %s: prefill of %d tokens for %s (%d blocks to push)", rid, len(prompt), peer,
                 num_blocks - skip)

    def fetch_prefix(self, request_id: str, tokens: list[int], cache_salt: str, holder: str,
                     held_tokens: int, timeout_s: float) -> Future | None:
        """Have `holder` (the asking decode worker) push the prompt blocks among its first
        `held_tokens` that this pool lacks (worker/prefix_fetch.py); the future resolves to a
        `Fetched`. None: nothing to fetch, not worth it, or no room."""
        if self.closing:
            return None
        source = pb.PrefixSource(address=holder, blocks=held_tokens // self.block_size)
        return self.fetches.start(request_id, tokens, cache_salt, source, timeout_s)

    def drop_departed_peers(self) -> None:
        """Disconnect from decode agents no longer in the membership, except those a push is
        still writing to (the next membership round drops them)."""
        members = self.members
        if members is None:
            return
        busy = {p.peer for p in self.requests.values()}
        for name in [n for n in self.agent.peers if n not in members and n not in busy]:
            log.info("peer %s left the deployment: disconnected", name)
            self.agent.remove_peer(name)

    def holds_work(self) -> bool:
        return bool(self.requests) or len(self.fetches) > 0  # each until nothing of it is in flight

    def holdings(self) -> Holdings:
        return Holdings(self.calls.open, len(self.requests), awaiting_kv=len(self.fetches),
                        held_blocks=self.engine.num_held())

    def fail_all(self, reason: str) -> None:
        """Steps keep failing, or the worker shuts down: abort every request (each is answered once nothing of it is
        in flight, and its decode worker moves on to another prefill worker or itself)."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.fetches.abort_all()

    def abort(self, request_id: str, confirmed: Future | None = None) -> None:
        """Stop a request; `confirmed` resolves (True if it was known) once nothing is in flight."""
        p = self.requests.get(request_id)
        if p is None:  # not here (yet): a Prefill for it that comes later is refused
            return self._early_aborts.not_here(request_id, confirmed)
        if confirmed is not None:
            p.abort_waiters.append(confirmed)
        self.engine.abort_request(request_id)  # its blocks are held until the push ends
        self.pusher.abort(request_id)
        log.info("request %s: abort asked", request_id)

    # -- the loop's hooks ----------------------------------------------------------------

    def on_step(self, result: StepResult) -> None:
        for rid in result.preempted:
            if rid in self.requests:
                # Its blocks went back to the pool while pushes may still read them: its writes
                # can no longer be trusted. Abort it; the decode worker, told once nothing is in
                # flight, rewrites those blocks (another prefill worker, or locally).
                log.info("request %s: preempted here (KV full); aborting it", rid)
                self.abort(rid)
        if result.chunks:
            result.wait_kv_written()  # a GPU step may still be writing the KV its pushes read
        now = time.monotonic()
        step_started = now - (result.stats.seconds if result.stats is not None else 0.0)
        sampled = {d.request_id: d for d in result.outputs}
        finishing = []
        for chunk in result.chunks:
            p = self.requests.get(chunk.request_id)
            if p is None:
                continue
            if p.first_chunk_at is None:  # queue time ends when its first chunk's step began
                p.first_chunk_at = step_started
                p.num_cached_tokens = chunk.num_cached_tokens
                worker_metrics.observe_first_step(p.num_prompt_tokens, p.num_cached_tokens, step_started - p.arrived)
                trace.event(p.request_id, "scheduled", at=step_started, cached_tokens=p.num_cached_tokens)
            delta = sampled.get(p.request_id)
            if delta is not None:  # the prompt is done: push the rest, the partial last block too
                p.first_token = delta.token_ids[0]
                p.first_logprobs = delta.logprobs[0] if delta.logprobs else None
                p.sampled_at = now
                trace.event(p.request_id, "computed", at=now)
                finishing.append(p.request_id)
                self._push(p, chunk.block_table, -(-p.num_prompt_tokens // self.block_size), last=True)
            else:
                self._push(p, chunk.block_table, chunk.context_len // self.block_size, last=False)
        if finishing:
            self._wait_for_pushes(finishing)
        self.fetches.release_claimed(self._first_chunk_ran)

    def _first_chunk_ran(self, request_id: str) -> bool:
        """Its first chunk ran (its schedule took the fetched blocks itself), or it ended."""
        p = self.requests.get(request_id)
        return p is None or p.first_chunk_at is not None

    def _wait_for_pushes(self, request_ids: list[str]) -> None:
        """Poll the pushes of `request_ids` briefly (bounded), so their replies need not wait
        for the next step to finish."""
        deadline = time.monotonic() + _LAST_PUSH_WAIT_S
        while any(rid in self.requests for rid in request_ids) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0002)  # not a spin: the decode worker whose progress this waits on may share the CPU

    def poll(self) -> bool:
        if len(self.fetches):
            for ev in self.fetches.receiver.poll():
                self.fetches.on_receive(ev)
            self.fetches.poll()
        self.fetches.release_claimed(self._first_chunk_ran)
        events = self.pusher.poll()
        for ev in events:
            p = self.requests.pop(ev.request_id, None)
            if ev.status is not PushStatus.DONE:  # failed before its prompt was done: stop computing it,
                self.engine.abort_request(ev.request_id)  # or its blocks would be held when it finishes
            self.engine.release(ev.request_id)
            if p is None:
                continue
            if ev.status is PushStatus.DONE:
                self.kv_blocks_transferred += len(p.dest_blocks)
                trace.event(p.request_id, "replied", blocks=len(p.dest_blocks))  # before the reply can overtake it
                p.reply.set_result(self._response(p))
            else:
                code = pb.CANCELLED if ev.status is PushStatus.ABORTED else pb.KV_TRANSFER_FAILED
                reason = ev.reason or ev.status.value
                trace.event(p.request_id, "push_failed", status=ev.status.value, reason=reason)
                p.reply.set_result(pb.PrefillResponse(error=pb.Error(code=code, message=f"KV push: {reason}",
                                                                     request_id=p.request_id)))
            for waiter in p.abort_waiters:
                waiter.set_result(True)
        return bool(events)

    def _push(self, p: _Prefill, table: list[int], upto: int, last: bool) -> None:
        if upto <= p.pushed and not last:
            return
        local = table[p.pushed:upto]
        remote = p.dest_blocks[p.pushed - p.skip_blocks:upto - p.skip_blocks]
        p.pushed = max(p.pushed, upto)
        self.pusher.push(p.request_id, local, remote, last=last)
        trace.event(p.request_id, "push_posted", blocks=len(local), last=last)

    def _response(self, p: _Prefill) -> pb.PrefillResponse:
        now = time.monotonic()
        first_chunk = p.first_chunk_at or now
        sampled = p.sampled_at or now
        resp = pb.PrefillResponse(
            first_token_id=p.first_token, num_cached_tokens=p.num_cached_tokens,
            timings=pb.Timings(queue_s=first_chunk - p.arrived, prefill_s=sampled - first_chunk,
                               transfer_s=now - sampled),
        )
        if p.first_logprobs is not None:
            resp.first_logprobs.CopyFrom(logprobs_to_pb(p.first_logprobs))
        return resp
