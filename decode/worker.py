"""The decode worker: owns each request from Generate to release (docs/design.md steps 5, 8-11).

Runs on its EngineLoop thread. A request with prefill workers and a long enough uncached
prompt reserves its blocks and asks the first prefill worker to fill them (moving down
the list if that one fails before the KV is complete, then prefilling locally); otherwise
it is prefilled here as chunked prefill in the decode batch (conditional disaggregation,
and the aggregated mode when no prefill workers are given). Every step's new tokens go to
the request's stream at once: the step's tokens for every stream of one call (a gateway's
Streams) leave as one message (decode/step_batches.py). A request's first message says how
it was served (pb.Served: the prefill worker whose KV it decodes from and how many blocks
came over, or why it was prefilled here), which the gateway's answer headers repeat before
its first byte. The remote prefills themselves (attempts, aborts, the KV notifications) are
decode/remote_prefill.py's; this worker applies their events.

A drain that hands off ends every request with HANDED_OFF; those between two decode steps
keep their KV here for the decode worker that takes them over, which asks for it as it
asks a prefill worker (decode/kv_source.py): a move costs a copy of the KV, not a prefill.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from common import trace
from common.block_hash import block_hashes
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from decode import metrics
from decode.kv_source import KVSource, NotHeld
from decode.remote_prefill import RemotePrefills
from decode.remote_prefill_events import Event, KVReady, PrefillHere, Quarantined, Released
from decode.step_batches import Outlet, StepBatches
from decode.unconfirmed_aborts import DEFAULT_ABORT_BOUND_S
from engine import prefix_blocks
from engine.llm_engine import LLMEngine, StepResult
from engine.scheduler import RequestRejected, SchedulerOutput
from rpc import pdserve_pb2 as pb
from rpc.convert import finish_to_pb, local_prefill_name, logprobs_to_pb
from transfer import TransferAgent
from worker import metrics as worker_metrics
from worker.holdings import Holdings
from worker.liveness import DEFAULT_STALL_FLOOR_S
from worker.loop import EngineLoop, ShuttingDown
from worker.prefix_fetch import Fetched, PrefixFetches

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where one request's responses go, and what its final message reports."""

    out: Outlet
    prompt_len: int
    params: SamplingParams
    arrived: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # its first step: its blocks reserved or its first chunk run
    first_token_at: float | None = None
    num_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens computed nowhere: its prefix cache hits, or its prefill worker's
    prefill_timings: pb.Timings | None = None
    local_prefill: int = pb.LOCAL_PREFILL_NONE  # why it is prefilled here (NONE: a remote prefill's KV)
    prefill_worker: str = ""  # whose KV it decodes from, once that KV is here
    kv_blocks: int = 0  # ... and how many blocks of it came over
    prefix_source: str = ""  # the sibling whose prefix blocks it fetched (worker/prefix_fetch.py)
    prefix_blocks: int = 0
    announced: bool = False  # its first message (with how it was served) has gone out


REMOTE_PREFILL_SLACK = 10.0  # a remote prefill may take this many times its measured compute


class DecodeWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, name: str, agent: TransferAgent | None = None,
                 local_prefill_threshold: int = 0, prefill_timeout_s: float = 60.0,
                 stall_floor_s: float = DEFAULT_STALL_FLOOR_S, abort_bound_s: float = DEFAULT_ABORT_BOUND_S,
                 kv_hand_off: bool = True):
        super().__init__(engine, name=f"{name}-loop", stall_floor_s=stall_floor_s)
        self.name = name
        self.agent = agent
        self.remote = RemotePrefills(agent, abort_bound_s, lambda: self.address) if agent is not None else None
        self.source = KVSource(agent, engine.block_size) if agent is not None else None
        self._last_step: StepResult | None = None  # the last step that ran: its KV writes end before a pull
        self.kv_hand_off = kv_hand_off  # a hand-off keeps KV for the taker (False: the taker prefills)
        self.local_prefill_threshold = local_prefill_threshold
        self.prefill_timeout_s = prefill_timeout_s
        self.streams: dict[str, _Stream] = {}
        self._touched: set[StepBatches] = set()  # calls with news gathered since the last flush
        self.kv_blocks_transferred = 0
        self.fetches: PrefixFetches | None = None
        if self.remote is not None:
            self.fetches = PrefixFetches(agent, self.remote.receiver, self.remote.peers, engine,
                                         lambda: self.liveness.prefill_tokens_per_s, self.loop_wait_s)
            self.remote.others = self.fetches.on_receive
            self.remote.others_pending = lambda: bool(self.fetches.fetches)
            # NIXL progress between layers while remote KV is awaited: a prefill worker's
            # push (and so its Prefill reply) completes only when this side progresses.
            self.between_layers = self.remote.progress

    # -- commands (run on the loop thread) -----------------------------------------------

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
            prefill_workers: list[str], out: Outlet, timeout_s: float | None,
            cache_salt: str = "", output_token_ids: list[int] = (), kv_source: pb.KVSource | None = None,
            fetched: Fetched | None = None) -> None:
        """Admit a request (raises RequestRejected / QueueFull / ShuttingDown for the RPC to answer);
        `output_token_ids`: a replay's tokens so far (their KV but the last's comes from the
        prefill workers, or is computed here); `kv_source`: a hand-off's, whose KV that decode
        worker kept (it heads `prefill_workers`: asked first, always); `fetched`: the prompt
        blocks its admission fetched from a sibling (worker/prefix_fetch.py), now cached here."""
        if self.closing:
            raise ShuttingDown(f"request {request_id}: {self.name} is shutting down")
        if (self.remote is not None and request_id in self.remote) or self.engine.holds_blocks(request_id):
            # Held blocks (waiting for a prefill worker's abort confirmation) are keyed by this id too.
            raise RequestRejected(request_id, "duplicate request id (one with this id is still in flight)")
        tokens = [*prompt, *output_token_ids]
        uncached = len(tokens) - self.engine.num_cached_tokens(tokens, cache_salt)
        remote = (bool(prefill_workers) and self.remote is not None
                  and (kv_source is not None or uncached > self.local_prefill_threshold))
        self.engine.add_request(request_id, prompt, params, priority, remote_prefill=remote, cache_salt=cache_salt,
                                output_token_ids=output_token_ids)
        self.streams[request_id] = _Stream(out, len(prompt), params,
                                           local_prefill=self._local_prefill(remote, prefill_workers, len(tokens)))
        if fetched is not None and fetched.blocks:
            self.streams[request_id].prefix_source = fetched.source
            self.streams[request_id].prefix_blocks = fetched.blocks
        if self.fetches is not None:
            self.fetches.claim(request_id)  # its fetched prefix stays pinned until its first step
        if remote:
            budget = self.remote_prefill_budget_s(uncached)
            self.remote.admit(request_id, prefill_workers, time.monotonic() + min(timeout_s or budget, budget),
                              kv_source)
        where = "local" if not remote else "kv_source" if kv_source is not None else "remote"
        metrics.PREFILLS.labels(where).inc()
        trace.event(request_id, "admitted", prefill=where, uncached_tokens=uncached,
                    kv_source=kv_source.address if kv_source is not None else None,
                    local_prefill=None if remote else local_prefill_name(self.streams[request_id].local_prefill))
        log.info("request %s: admitted, %d prompt tokens (%d uncached)%s, %s", request_id, len(prompt),
                 uncached, f", a replay after {len(output_token_ids)} output tokens" if output_token_ids else "",
                 f"KV from {kv_source.address}" if where == "kv_source" else f"{where} prefill")

    def _local_prefill(self, remote: bool, prefill_workers: list[str], num_tokens: int) -> int:
        """Why a request is prefilled here from the start (a pb.LocalPrefill; NONE: it is not)."""
        if remote:
            return pb.LOCAL_PREFILL_NONE
        if not prefill_workers or self.remote is None:
            return pb.LOCAL_PREFILL_NO_PREFILL_WORKER
        if num_tokens > self.local_prefill_threshold:  # long enough, but its uncached part is not
            return pb.LOCAL_PREFILL_PREFIX_CACHE_HIT
        return pb.LOCAL_PREFILL_BELOW_THRESHOLD

    def remote_prefill_budget_s(self, uncached_tokens: int) -> float:
        """How long a remote prefill of this many tokens may take, all attempts together,
        before it is aborted and prefilled here: `--prefill-timeout`, or REMOTE_PREFILL_SLACK
        times what this worker measured itself computing that prompt in, if longer (a slow
        host gets the time its speed needs; a prefill worker's queue and the transfer are
        in the slack)."""
        rate = self.liveness.prefill_tokens_per_s
        measured = REMOTE_PREFILL_SLACK * uncached_tokens / rate if rate > 0 else 0.0
        return max(self.prefill_timeout_s, measured)

    def cancel(self, request_id: str) -> None:
        """The client went away: stop the request within a step; blocks a prefill worker may
        still be writing are freed only once it confirms (or is known dead)."""
        if request_id not in self.streams:
            return  # already finished (gRPC calls back on every end of the call)
        self.engine.abort_request(request_id)
        if self.remote is not None:
            self.remote.cancel(request_id, self.engine.holds_blocks(request_id))
        self._close(request_id, pb.GenerateResponse(finish_reason=pb.ABORT))
        self._flush()
        trace.event(request_id, "cancelled")
        log.info("request %s: cancelled", request_id)

    def fail_all(self, reason: str) -> None:
        """Steps keep failing, or the worker shuts down: every request ends with an INTERNAL
        error (blocks a prefill worker may be writing stay held until it confirms, as for a cancel)."""
        for request_id in list(self.streams):
            self._end(request_id, pb.INTERNAL, reason)
        self._flush()
        if self.source is not None:
            self.source.drop_all()
        if self.fetches is not None:
            self.fetches.abort_all()

    def hand_off(self) -> None:
        """Drained: every request ends here with HANDED_OFF, and its gateway replays it on
        another decode worker from the tokens it streamed (gateway/decode_stream.py). One
        between two decode steps keeps its KV here until that worker has copied it (or
        `kv_hold_s` passed); any other (waiting, preempted, mid-prefill) moves as what it is."""
        if not self.streams:
            return
        handed, kept = len(self.streams), 0
        for request_id in list(self.streams):
            kv = self.engine.keep(request_id) if self.source is not None and self.kv_hand_off else None
            if kv is not None:  # ended already, its blocks held: _end only closes its stream
                self.source.keep(kv, self.kv_hold_s(len(kv.token_ids)))
                kept += 1
            self._end(request_id, pb.HANDED_OFF,
                      f"handed off: {self.name} is leaving" + ("; its KV is kept there" if kv is not None else ""))
        self._flush()
        log.info("%s: handed off %d requests, %d with their KV kept for their takers", self.name, handed, kept)

    def kv_hold_s(self, num_tokens: int) -> float:
        """How long a handed-off request's KV is kept for its taker: what that worker allows
        a remote prefill of as many tokens (its gateway's replay and its own queue are in
        the slack); past it, the taker has moved on without it."""
        return self.remote_prefill_budget_s(num_tokens)

    def pull(self, req: pb.PrefillRequest, reply: Future, timeout_s: float | None) -> None:
        """A taker's pull of a handed-off request's kept KV (decode/kv_source.py); taken while
        draining too, which is when there is any. ValueError when it cannot be served."""
        if self.source is None:
            raise ValueError(f"request {req.request_id}: {self.name} has no transfer agent and keeps no KV")
        # The blocks it pushes were written by steps up to the last: on a GPU that one may still
        # be writing (a step that samples no row returns first), and the taker adopts what it reads.
        if self._last_step is not None:
            self._last_step.wait_kv_written()
        if req.prefix_only:
            self._pull_prefix(req, reply, timeout_s)
        else:
            self.source.pull(req, reply, timeout_s)

    def fetch_prefix(self, request_id: str, tokens: list[int], cache_salt: str,
                     source: pb.PrefixSource) -> Future | None:
        """Have a sibling decode worker push the prompt's leading blocks it holds and this
        pool lacks (worker/prefix_fetch.py); the future resolves to a `Fetched`. None: nothing
        to fetch, not worth it, no room or no agent."""
        if self.fetches is None or self.closing:
            return None
        budget = self.remote_prefill_budget_s(source.blocks * self.engine.block_size)
        return self.fetches.start(request_id, tokens, cache_salt, source, budget)

    def _pull_prefix(self, req: pb.PrefillRequest, reply: Future, timeout_s: float | None) -> None:
        """A sibling's fetch of prompt blocks this worker's prefix cache holds: those after
        its own cached ones, in a row, pinned until the push ends."""
        if self.closing:
            raise NotHeld(f"request {req.request_id}: {self.name} is shutting down")
        engine, bs = self.engine, self.engine.block_size
        hashes = block_hashes(list(req.prompt_token_ids), bs, req.cache_salt)
        skip = req.destination.num_cached_tokens // bs
        blocks = prefix_blocks.held_run(engine, hashes, skip, len(req.destination.block_ids))
        if not blocks:
            raise NotHeld(f"request {req.request_id}: none of the {len(hashes) - skip} prefix blocks asked for "
                          "is cached here now")
        prefix_blocks.pin(engine, blocks)
        try:
            self.source.pull_prefix(req, blocks, reply, timeout_s, lambda: prefix_blocks.unpin(engine, blocks))
        except BaseException:
            prefix_blocks.unpin(engine, blocks)
            raise

    def abort_pull(self, request_id: str, confirmed: Future | None = None) -> None:
        if self.source is not None:
            self.source.abort(request_id, confirmed)
        elif confirmed is not None:
            confirmed.set_result(False)

    def _end(self, request_id: str, code: int, message: str) -> None:
        self.engine.abort_request(request_id)
        if self.remote is not None:
            self.remote.cancel(request_id, self.engine.holds_blocks(request_id))
        self._close(request_id, pb.GenerateResponse(
            finish_reason=pb.ERROR, error=pb.Error(code=code, message=message, request_id=request_id)))
        trace.event(request_id, "ended_here", code=pb.ErrorCode.Name(code))

    def proven_prefill_workers(self, addresses: list[str], timeout_s: float) -> list[str]:
        """The offered prefill workers that proved they belong to this deployment (RPC thread)."""
        return self.remote.proven(addresses, timeout_s) if self.remote is not None else []

    def set_members(self, addresses: list[str]) -> None:
        """The deployment's workers (SetPeers; any thread): at once, only these are asked for
        prefills; on the loop, blocks set aside for one that left are free again
        (decode/unconfirmed_aborts.py)."""
        if self.remote is None:
            return
        remote = self.remote
        remote.members = frozenset(addresses)
        self.submit(lambda: self._apply(remote.set_members(addresses)))

    def holds_work(self) -> bool:
        # Its remote prefills' late writes die with this process; KV kept for a taker is held until released.
        return (bool(self.streams) or (self.source is not None and len(self.source) > 0)
                or (self.fetches is not None and len(self.fetches) > 0))

    def holdings(self) -> Holdings:
        """Its streams, its remote prefills (a cancelled one too, until its prefill worker
        confirms the abort) and blocks set aside for an unconfirmed abort or kept for a
        hand-off's taker: a drain waits for all of them, so no prefill worker writes into a
        stopped worker's pool and no taker finds the KV it was promised gone."""
        awaiting = len(self.remote) + len(self.fetches) if self.remote is not None else 0
        return Holdings(self.calls.open, len(self.streams), awaiting, self.engine.num_held())

    # -- the loop's hooks ----------------------------------------------------------------

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """A Prefill goes out in the step that reserved its blocks, before that step's forward
        pass, not after it."""
        now = time.monotonic()
        # A request's first step: its blocks reserved for a remote prefill, or the first chunk
        # of a local one (it starts past the cached prefix); decode chunks are skipped at once.
        firsts = [c.seq for c in out.chunks if c.start == c.seq.num_cached_tokens]
        for seq in [rp.seq for rp in out.remote_prefills] + firsts:
            stream = self.streams.get(seq.request_id)
            if stream is not None and stream.scheduled_at is None:
                stream.scheduled_at = now
                worker_metrics.observe_first_step(len(seq.prompt_token_ids), seq.num_cached_tokens,
                                                  now - stream.arrived)
                trace.event(seq.request_id, "scheduled", cached_tokens=seq.num_cached_tokens)
        if self.fetches is not None:
            self.fetches.release_claimed(self._first_step_taken)
        if out.remote_prefills:
            for rp in out.remote_prefills:
                stream = self.streams.get(rp.seq.request_id)
                if stream is not None:
                    stream.cached_tokens = rp.num_cached_tokens
            self._apply(self.remote.start(out.remote_prefills))  # one that could not go out: prefilled here

    def poll(self) -> bool:
        if self.remote is None:
            return False
        events = self.remote.poll()  # (the prefix fetches' notifications too)
        self._apply(events)
        if len(self.fetches):
            self.fetches.poll()
        self.fetches.release_claimed(self._first_step_taken)
        released = self.source.poll() if len(self.source) else []
        for request_id in released:
            self.engine.release(request_id)
        return bool(events) or bool(released)

    def on_step(self, result: StepResult) -> None:
        self._last_step = result  # a pull waits for its KV writes (pull)
        for d in result.outputs:
            self._deliver(d.request_id, d.token_ids, d.finish_reason, d.logprobs, d.num_cached_tokens)
        self._flush()

    def _apply(self, events: list[Event]) -> None:
        """What the remote prefills ask of the engine and the streams."""
        for ev in events:
            if isinstance(ev, KVReady):
                self.kv_blocks_transferred += ev.num_blocks
                stream = self.streams.get(ev.request_id)
                if stream is not None:
                    stream.prefill_timings = ev.timings
                    stream.prefill_worker, stream.kv_blocks = ev.worker, ev.num_blocks
                    stream.cached_tokens = max(stream.cached_tokens, ev.num_cached_tokens)  # the prefill worker's too
                t = ev.timings
                trace.event(ev.request_id, "kv_ready", blocks=ev.num_blocks, prefill_worker=ev.worker,
                            prefill_queue_s=t.queue_s if t else None, prefill_compute_s=t.prefill_s if t else None,
                            prefill_push_s=t.transfer_s if t else None)
                update = self.engine.remote_kv_ready(ev.request_id, ev.first_token)
                if update is not None and (update.new_token_ids or update.finish_reason is not None):
                    # (a replay's has no token: it decodes its last one next)
                    lps = [ev.first_logprobs] if ev.first_logprobs is not None else None
                    self._deliver(ev.request_id, update.new_token_ids, update.finish_reason, lps,
                                  ev.num_cached_tokens)
            elif isinstance(ev, PrefillHere):
                self._prefill_here(ev.request_id, ev.cause)
            elif isinstance(ev, Released):
                self.engine.release(ev.request_id)
            elif isinstance(ev, Quarantined):
                self.engine.quarantine(ev.request_id, ev.quarantine_id)
                if not ev.cancelled:
                    self._prefill_here(ev.request_id, pb.LOCAL_PREFILL_ABORT_UNCONFIRMED)
        self._flush()

    def _first_step_taken(self, request_id: str) -> bool:
        """Its first step reserved its blocks or ran its first chunk, or it ended."""
        stream = self.streams.get(request_id)
        return stream is None or stream.scheduled_at is not None

    def _prefill_here(self, request_id: str, cause: int) -> None:
        """A remote prefill fell back to a local one (`cause`: a pb.LocalPrefill)."""
        name = local_prefill_name(cause)
        metrics.FALLBACKS.labels(name).inc()
        trace.event(request_id, "local_prefill", cause=name)
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.local_prefill = cause
        self.engine.remote_kv_failed(request_id)

    # -- streams --------------------------------------------------------------------------

    def _deliver(self, request_id: str, token_ids: list[int], reason: FinishReason | None, logprobs,
                 num_cached: int) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        now = time.monotonic()
        if stream.first_token_at is None and token_ids:
            stream.first_token_at = now
            trace.event(request_id, "first_token")
        if not stream.announced:  # before its first tokens: the gateway's headers need it first
            stream.announced = True
            stream.out.served(pb.Served(prefill_worker=stream.prefill_worker, kv_blocks=stream.kv_blocks,
                                        local_prefill=stream.local_prefill,
                                        cached_prompt_tokens=_cached(stream, num_cached),
                                        prefix_source=stream.prefix_source, prefix_blocks=stream.prefix_blocks))
        stream.num_tokens += len(token_ids)
        self._touched.add(stream.out.batches)
        if reason is None and not logprobs:
            if token_ids:
                stream.out.tokens(token_ids)  # the common case: a column of the step's message
            return
        msg = pb.GenerateResponse(token_ids=token_ids, finish_reason=finish_to_pb(reason))
        if logprobs:
            msg.logprobs.extend(logprobs_to_pb(lp) for lp in logprobs)
        if reason is not None:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=stream.prompt_len, completion_tokens=stream.num_tokens,
                                        cached_prompt_tokens=_cached(stream, num_cached)))
            timings = pb.Timings(first_token_s=(stream.first_token_at or now) - stream.arrived)
            if stream.prefill_timings is not None:
                timings.queue_s = stream.prefill_timings.queue_s
                timings.prefill_s = stream.prefill_timings.prefill_s
                timings.transfer_s = stream.prefill_timings.transfer_s
            msg.timings.CopyFrom(timings)
            if reason is FinishReason.ERROR:
                msg.error.CopyFrom(pb.Error(code=pb.PREFILL_FAILED, message="prefill failed", request_id=request_id))
        stream.out.put(msg)
        if reason is not None:
            del self.streams[request_id]
            trace.event(request_id, "finished", reason=reason.value, completion_tokens=stream.num_tokens)

    def _close(self, request_id: str, msg: pb.GenerateResponse) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.out.put(msg)
            self._touched.add(stream.out.batches)  # sent by the caller's _flush: not a step's, so now

    def _flush(self) -> None:
        """The step's news leaves: one message per call that got any."""
        for batches in self._touched:
            batches.flush()
        self._touched.clear()


def _cached(stream: _Stream, num_cached: int) -> int:
    """The prompt tokens its prefix cache served (a replay's hits cover output too: capped)."""
    return min(stream.prompt_len, max(num_cached, stream.cached_tokens))
