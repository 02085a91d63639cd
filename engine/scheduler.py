"""Iteration-level continuous batching with chunked prefill, priorities and preemption.

Each `schedule()` fills one step: running sequences first (decodes, then unfinished
prefill chunks), then waiting ones by (priority, arrival), within a token budget, a
sequence cap and the KV blocks the pool can give. A long prompt is cut into chunks, so
decodes run every step beside it; a chunk first takes at most `prefill_chunk_cap` tokens
so that waiting prompts are admitted in the same step, then what is left of the budget
tops the cut chunks up. A long prompt never holds a short one back by more than a step. When blocks run out a
running sequence is preempted by recompute: the least important (highest priority value,
newest) gives its blocks back and returns to the waiting queue with its output kept.

No tensors here: the output is ids, counts and block ids; the runner builds tensors.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import KeptKV, Sequence, SequenceStatus

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the pool); names why."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id}: {reason}")
        self.request_id = request_id


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should shed or retry elsewhere."""


@dataclass(slots=True)
class ScheduledChunk:
    """`num_new` tokens of `seq` starting at position `start`, to compute this step.
    Read-only once made; not frozen, as one is made for every running sequence every step
    (a frozen dataclass's init costs 3.5x a slotted one's)."""

    seq: Sequence
    start: int
    num_new: int
    block_table: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_new]

    @property
    def context_len(self) -> int:
        return self.start + self.num_new

    @property
    def sample(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.context_len == self.seq.num_tokens


@dataclass(frozen=True)
class RemotePrefill:
    """Blocks reserved for a prompt whose KV a prefill worker will write.

    `block_table` covers the whole sequence; its first `num_cached_tokens // block_size`
    blocks came from the local prefix cache, the rest up to `kv_token_ids` are the
    transfer's destination. For a new request that is the prompt (the writer samples the
    first token); for a replay (output tokens produced elsewhere) every token but the last,
    which is decoded here next.
    """

    seq: Sequence
    block_table: list[int]
    num_cached_tokens: int
    block_size: int

    @property
    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the writer fills."""
        return self.seq.token_ids[:-1] if self.seq.output_token_ids else list(self.seq.prompt_token_ids)

    @property
    def destination_blocks(self) -> list[int]:
        num_blocks = -(-len(self.kv_token_ids) // self.block_size)
        return self.block_table[self.num_cached_tokens // self.block_size:num_blocks]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[str] = field(default_factory=list)
    remote_prefills: list[RemotePrefill] = field(default_factory=list)  # newly reserved this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SequenceUpdate:
    """What one step did to one sequence: tokens appended and, if it ended, why. Read-only
    once made (not frozen, for the same reason as ScheduledChunk)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None


def _importance(seq: Sequence) -> tuple[int, int]:
    """Sort key: the most important first (lowest priority value, then the oldest)."""
    return seq.priority, seq.arrival


def _is_prefill(chunk: ScheduledChunk) -> bool:
    """Sort key: decodes (one token to compute) before prefill chunks."""
    return chunk.num_new > 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: frozenset[int]):
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq)
        self._num_waiting = 0
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.awaiting_kv: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV, by request id
        self.held: set[str] = set()  # finished requests whose blocks wait for release()

    # -- intake ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise RequestRejected / QueueFull at once."""
        if seq.request_id in self.requests:
            raise RequestRejected(seq.request_id, "duplicate request id")
        if not seq.prompt_token_ids:
            raise RequestRejected(seq.request_id, "empty prompt")
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if total > self.config.max_model_len:
            raise RequestRejected(
                seq.request_id,
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {total} "
                f"exceeds the context limit of {self.config.max_model_len}",
            )
        need = -(-total // self.kv.block_size)
        if need > self.kv.num_total_blocks:
            raise RequestRejected(
                seq.request_id,
                f"needs {need} KV blocks but the pool has only {self.kv.num_total_blocks}",
            )
        bound = self.config.max_waiting
        if bound is not None and self._num_waiting >= bound:
            raise QueueFull(f"request {seq.request_id}: waiting queue is full ({bound})")
        seq.arrival = next(self._arrivals)
        self.requests[seq.request_id] = seq
        self._push_waiting(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request wherever it is and give back its blocks; None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped lazily
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.awaiting_kv[request_id]
            seq.hold_blocks = True  # a write may still land: release() once the writer confirms
        self._finish(seq, FinishReason.ABORT)
        return seq

    # -- disaggregation -------------------------------------------------------------------

    def remote_kv_ready(self, request_id: str, first_token: int) -> SequenceUpdate | None:
        """The prompt's KV has landed and the prefill worker sampled `first_token`: decode.
        A replay's KV covers every token but its last, which it decodes next: `first_token`
        is not taken (its update has no token)."""
        seq = self.awaiting_kv.pop(request_id, None)
        if seq is None:
            return None
        seq.remote_prefill = False  # a later preemption recomputes here (prompt and output)
        replay = bool(seq.output_token_ids)
        seq.num_computed_tokens = seq.num_tokens - 1 if replay else seq.num_prompt_tokens
        self.kv.cache_blocks(request_id, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)
        if replay:
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
            return SequenceUpdate(request_id, [], None)
        seq.append_token(first_token)
        reason = self._finish_reason(seq, first_token)
        if reason is None:
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
        else:
            self._finish(seq, reason)
        return SequenceUpdate(request_id, [first_token], reason)

    def remote_kv_failed(self, request_id: str, recompute: bool) -> SequenceUpdate | None:
        """The remote prefill failed with no write in flight: prefill locally, or fail the request."""
        seq = self.awaiting_kv.pop(request_id, None)
        if seq is None:
            return None
        if not recompute:
            self._finish(seq, FinishReason.ERROR)
            return SequenceUpdate(request_id, [], FinishReason.ERROR)
        log.info("request %s: remote prefill failed, prefilling locally", request_id)
        self.kv.free(request_id)  # prefix-cached blocks stay findable for the local admission
        seq.remote_prefill = False
        seq.num_computed_tokens = 0
        self._push_waiting(seq)
        return None

    def keep(self, request_id: str) -> KeptKV | None:
        """End a running request whose KV covers every token but its last (the state between
        two decode steps), holding its blocks until release(): what a decode worker that
        takes it over copies. None, and nothing done, for a request in any other state
        (waiting, preempted, mid-prefill, awaiting KV): it moves as what it is."""
        seq = self.requests.get(request_id)
        if (seq is None or seq.status is not SequenceStatus.RUNNING or not seq.output_token_ids
                or seq.num_computed_tokens != seq.num_tokens - 1):
            return None
        num_blocks = -(-seq.num_computed_tokens // self.kv.block_size)
        kept = KeptKV(request_id, seq.token_ids[:-1], seq.token_ids[-1],
                      self.kv.block_table(request_id)[:num_blocks])
        self.running.remove(seq)
        seq.hold_blocks = True
        self._finish(seq, FinishReason.ABORT)
        return kept

    def quarantine(self, request_id: str, quarantine_id: str) -> None:
        """Blocks a remote writer may still be writing, set aside under `quarantine_id` (held
        until release(quarantine_id)); the request keeps its id, with no blocks: awaiting
        KV, remote_kv_failed() then prefills it here into new ones."""
        self.kv.rename(request_id, quarantine_id)
        if request_id in self.held:
            self.held.discard(request_id)
        self.held.add(quarantine_id)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished request held (hold_blocks, or aborted while awaiting KV)."""
        if request_id in self.held:
            self.held.discard(request_id)
            self.kv.free(request_id)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # (sequence, tokens it has not computed): decodes first, then prefill chunks, each in
        # order of importance (the order `running` is kept in)
        todo = [(s, left) for s in self.running if (left := len(s.token_ids) - s.num_computed_tokens) == 1]
        todo += [(s, left) for s in self.running if (left := len(s.token_ids) - s.num_computed_tokens) > 1]
        cap = self.config.prefill_chunk_cap
        for seq, left in todo:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(left, budget, cap)
            start = seq.num_computed_tokens
            table, refund = self._allocate_or_preempt(seq, start + num_new, out)
            budget += refund
            if table is None:
                continue
            out.chunks.append(ScheduledChunk(seq, start, num_new, table))
            budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        if budget > 0:
            budget = self._top_up(out, budget)
        # Decodes first, then prefill chunks: the runner batches single-token queries together
        # (already so when every chunk is one token, as in most steps of a decode pool).
        if self.config.max_num_batched_tokens - budget != len(out.chunks):
            out.chunks.sort(key=_is_prefill)
        return out

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int,
                             out: SchedulerOutput) -> tuple[list[int] | None, int]:
        """Blocks for `seq`, preempting the least important running sequences until they fit.

        Returns the block table (None if `seq` itself was preempted) and the token budget
        given back by victims that had already been scheduled in this step.
        """
        refund = 0
        while True:
            table = self.kv.allocate_slots(seq.request_id, num_tokens)
            if table is not None:
                return table, refund
            victim = max(self.running, key=_importance)
            for i, chunk in enumerate(out.chunks):
                if chunk.seq is victim:
                    refund += chunk.num_new
                    del out.chunks[i]
                    break
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is seq:
                return None, refund

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        # A reservation awaiting remote KV runs once it lands: it takes its seat now.
        while budget > 0 and len(self.running) + len(self.awaiting_kv) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            cached_blocks, num_cached = self.kv.get_computed_blocks(seq.token_ids, seq.cache_salt)
            if seq.remote_prefill:  # reserve the whole prompt; no compute here
                table = self.kv.allocate_slots(seq.request_id, seq.num_tokens, cached_blocks)
                if table is None:
                    break
                self._pop_waiting()
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
                seq.num_cached_tokens = num_cached
                self.awaiting_kv[seq.request_id] = seq
                out.remote_prefills.append(RemotePrefill(seq, table, num_cached, self.kv.block_size))
                continue
            num_new = min(seq.num_tokens - num_cached, budget, self.config.prefill_chunk_cap)
            table = self.kv.allocate_slots(seq.request_id, num_cached + num_new, cached_blocks)
            if table is None:
                break  # wait for blocks; admission keeps priority order
            self._pop_waiting()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self._run(seq)
            out.chunks.append(ScheduledChunk(seq, num_cached, num_new, table))
            budget -= num_new
        return budget

    def _top_up(self, out: SchedulerOutput, budget: int) -> int:
        """Give the budget left after admission to prefill chunks that the cap cut short,
        those closest to done first (a short prompt finishes in this step); returns what
        is left of it."""
        # only chunks short of their sequence's end (a decode never is)
        short = sorted((left, i) for i, c in enumerate(out.chunks)
                       if (left := len(c.seq.token_ids) - c.start - c.num_new) > 0)
        for left, i in short:
            if budget == 0:
                break
            chunk = out.chunks[i]
            seq = chunk.seq
            extra = min(left, budget)
            table = self.kv.allocate_slots(seq.request_id, chunk.context_len + extra)
            if table is None:
                break  # no preemption for a top-up: the step is already full enough
            out.chunks[i] = ScheduledChunk(seq, chunk.start, chunk.num_new + extra, table)
            budget -= extra
        return budget

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[SequenceUpdate]:
        """Advance progress counters, append sampled tokens, finish and free what ended."""
        updates = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += chunk.num_new
            self.kv.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)
            if not chunk.sample:
                continue
            token = sampled[seq.request_id]
            seq.append_token(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            updates.append(SequenceUpdate(seq.request_id, [token], reason))
        return updates

    # -- helpers --------------------------------------------------------------------------

    def _run(self, seq: Sequence) -> None:
        """Into `running`, kept in order of importance (so no step sorts it)."""
        bisect.insort(self.running, seq, key=_importance)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq` ends with `token` appended, if it does."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        log.info("request %s: preempted (recompute), %d tokens", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.hold_blocks:
            self.held.add(seq.request_id)
        else:
            self.kv.free(seq.request_id)
        del self.requests[seq.request_id]

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _pop_waiting(self) -> None:
        heapq.heappop(self._waiting)
        self._num_waiting -= 1

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][2].status is not SequenceStatus.WAITING:
            heapq.heappop(self._waiting)  # drop entries of aborted requests
        return self._waiting[0][2] if self._waiting else None

    # -- introspection --------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def waiting_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for _, _, s in self._waiting
                   if s.status is SequenceStatus.WAITING)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
