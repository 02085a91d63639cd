"""The in-process engine: scheduler + model runner, one step at a time.

    out = engine.schedule()             # which tokens of which requests, which blocks
    result = engine.execute(out)        # forward, sample, progress, stops, frees -> StepResult

`step()` is the two together, for offline use. A worker calls them apart: between the
two it sees what the schedule reserved (`out.remote_prefills`: blocks for KV a prefill
worker will write) and can send those prefills before this step's compute. Everything a
worker needs from the scheduler and the KV manager is a method here; their objects stay
inside the engine.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from common.engine_stats import EngineStats
from common.grammar_spec import GrammarError
from common.sampling_params import SamplingParams
from engine.cached_compiler import Busy as CompilerBusy
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype
from engine.disk_tier import DiskTier, DiskTierStats, checkpoint_fingerprint, compatibility_key
from engine.grammar import MAX_COMPILE_WAITERS, Grammars
from engine.host_memory import keep_freed_memory
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventBuffer
from engine.model import CausalLM
from engine.model_runner import ModelRunner, RunnerOutput
from engine.outputs import RequestOutput
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.rank_group import LeaderRunner, RankGroup
from engine.parallel.sharded_weights import load_sharded_model
from engine.scheduler import QueueFull, RequestRejected, ScheduledChunk, Scheduler, SchedulerOutput, SequenceUpdate
from engine.sequence import KeptKV, Sequence
from engine.step_buffers import StepLimits
from engine.weights import load_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    seconds: float


@dataclass(frozen=True)
class ChunkRun:
    """One request's chunk that a step ran: its blocks, how far its KV reaches now, and the
    prompt tokens its prefix cache served. `block_table` is the scheduler's own list (no copy
    on the step's path): read it before the next schedule."""

    request_id: str
    block_table: list[int]
    context_len: int
    num_cached_tokens: int


@dataclass(frozen=True)
class StepResult:
    """What one step did: a delta per request that produced tokens (or ended), the requests
    it preempted, the chunks it ran, and its size and duration (None when nothing was
    scheduled)."""

    outputs: list[RequestOutput]
    preempted: list[str]
    stats: StepStats | None
    scheduled: list[ScheduledChunk] = field(default_factory=list)  # the schedule's chunks, as run
    kv_written: object = None  # on a GPU, an event recorded after the step's KV writes; None on CPU

    @functools.cached_property
    def chunks(self) -> list[ChunkRun]:
        """The chunks the step ran, made when first read (a prefill worker's pushes read
        them; a decode worker's steps need not pay for them): read before the next schedule."""
        return [ChunkRun(c.seq.request_id, c.block_table, c.start + c.num_new, c.seq.num_cached_tokens)
                for c in self.scheduled]

    @property
    def ran(self) -> bool:
        return self.stats is not None

    def wait_kv_written(self) -> None:
        """Block until the step's KV is in memory. On a GPU a step that samples no row
        returns before its kernels finish: anything that reads its KV blocks from outside
        the stream (a NIXL write) must wait for this first. A no-op on CPU."""
        if self.kv_written is not None:
            self.kv_written.synchronize()


class LLMEngine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None):
        """Loads the weights from `config.model_path`, or runs `model`: the weights of another
        engine of the same model, dtype and device (`over_weights_of`)."""
        self.config = config
        self._on_cuda = torch.device(config.device).type == "cuda"  # steps record a KV-written event
        t0 = time.perf_counter()
        if not self._on_cuda:
            keep_freed_memory()
        weights = "kept"
        sched = config.scheduler
        limits = StepLimits(sched.max_num_batched_tokens, sched.max_num_seqs,
                            -(-sched.max_model_len // config.cache.block_size))
        # With tensor parallelism this process is rank 0: its pool holds its KV heads only,
        # and the memory budget is each rank's.
        layout = kv_cfg = self.ranks = None
        self.disk_tier: DiskTier | None = None
        if config.tensor_parallel_size > 1:
            # a latent model's group on CPU with shared pools keeps one pool (rank_group.py): the tier reads
            # and writes it for every rank
            one_pool = config.model.mla is not None and config.share_rank_pools and not self._on_cuda
            if config.cache.disk_dir is not None and not one_pool:
                raise ValueError(f"a disk tier ({config.cache.disk_dir}) is not supported with tensor parallelism "
                                 f"(tensor_parallel_size={config.tensor_parallel_size}): each rank's pool holds "
                                 "its own KV heads (a latent model's ranks sharing one pool on CPU excepted); "
                                 "serve it without the disk tier")
            if model is not None:
                raise ValueError("a tensor-parallel engine loads its own weights: it cannot run another's")
            layout = TensorParallelLayout.of(config.model, config.tensor_parallel_size, 0)  # refuses a wrong degree
            kv_cfg = layout.local_config(config.model)
        num_blocks = config.cache.resolve_num_blocks((kv_cfg or config.model).kv_bytes_per_token(config.dtype))
        if layout is not None:  # the other ranks' pools have the same blocks as this one's
            self.ranks = RankGroup(config, num_blocks + 1, limits)
            try:
                model, weights = load_sharded_model(config.model_path, config.model, layout, config.dtype,
                                                    config.device, mtp=config.load_mtp), "loaded"
            except BaseException:
                self.ranks.close()
                raise
        elif model is None:
            model, weights = CausalLM(config.model, config.dtype, config.device, config.load_mtp), "loaded"
            load_weights(model, config.model_path)
            model.prepare()
        # One physical block more than the manager hands out: the deep-health probe's scratch.
        self.kv_cache = KVCache(kv_cfg or config.model, num_blocks + 1, config.cache.block_size, config.dtype,
                                config.device, self.ranks.group_pool if self.ranks is not None else None)
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        if config.cache.disk_dir is not None:
            key = compatibility_key(config.model, checkpoint_fingerprint(config.model_path), config.dtype,
                                    config.cache.block_size)
            self.disk_tier = DiskTier(Path(config.cache.disk_dir), key, self.kv_cache.pool, config.cache.disk_bytes)
            self.kv_manager.use_lower_tier(self.disk_tier)
        eos = frozenset(config.model.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, eos)
        if self.ranks is None:
            self.runner = ModelRunner(model, self.kv_cache, config.device, limits)
        else:
            self.runner = LeaderRunner(model, self.kv_cache, config.device, limits, self.ranks)
        self.model = model
        self._probe_block = num_blocks
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        log.info("engine ready in %.1fs: %s %s (weights %s), %d KV blocks of %d tokens (%.0f MiB)",
                 time.perf_counter() - t0, config.model.name, config.dtype, weights, num_blocks,
                 config.cache.block_size, self.kv_cache.total_bytes / 2**20)
        if config.model.mtp_layers:
            log.info("config.json names %d multi-token-prediction layer(s): %s", config.model.mtp_layers,
                     "loaded" if config.load_mtp else "not loaded (load_mtp loads them)")

    @classmethod
    def from_folder(
        cls,
        path,
        dtype: str | torch.dtype = "auto",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        tensor_parallel_size: int = 1,
        share_rank_pools: bool = False,
        device: str = "cpu",
    ) -> LLMEngine:
        model_cfg = ModelConfig.from_pretrained(path)
        if eos_token_ids:
            model_cfg = _with_eos(model_cfg, eos_token_ids)
        sched = scheduler or SchedulerConfig(max_model_len=model_cfg.max_model_len)
        if sched.max_model_len > model_cfg.max_model_len:
            raise ValueError(f"max_model_len={sched.max_model_len} exceeds the model's "
                             f"limit of {model_cfg.max_model_len}")
        return cls(EngineConfig(model_cfg, path, resolve_dtype(dtype, device)[0], cache or CacheConfig(), sched,
                                device=device, tensor_parallel_size=tensor_parallel_size,
                                share_rank_pools=share_rank_pools))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank) and the disk
        tier's writer (after what it has queued). Bounded."""
        if self.ranks is not None:
            self.ranks.close()
        if self.disk_tier is not None:
            self.disk_tier.close()

    def over_weights_of(self, cache: CacheConfig, scheduler: SchedulerConfig) -> LLMEngine:
        """A new engine, with its own KV pool and scheduler sized by `cache` and `scheduler`,
        over this engine's loaded weights (a worker changing role keeps them: no load).
        This engine must hold nothing; it is not usable afterwards (its model is shared)."""
        if self.has_unfinished() or self.num_held():
            raise RuntimeError(f"an engine holding {self.num_unfinished()} requests and {self.num_held()} held "
                               "block sets cannot hand its weights over")
        if scheduler.max_model_len > self.config.model.max_model_len:
            raise ValueError(f"max_model_len={scheduler.max_model_len} exceeds the model's "
                             f"limit of {self.config.model.max_model_len}")
        model, config = self.model, replace(self.config, cache=cache, scheduler=scheduler)
        if self.disk_tier is not None:  # the new engine opens its own (another folder, maybe)
            self.disk_tier.close()  # it lets go of this engine's pool too
        self.model = self.runner = self.kv_cache = None  # its KV pool is freed before the new one is made
        return LLMEngine(config, model)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, remote_prefill: bool = False, hold_blocks: bool = False,
                    cache_salt: str = "", output_token_ids: list[int] = ()) -> None:
        """Queue a request. remote_prefill: reserve blocks for KV written by a prefill worker
        (a schedule's `remote_prefills` names them); hold_blocks: keep its blocks after it
        finishes until release() (a prefill worker pushing them); output_token_ids: a replay's
        tokens produced elsewhere, which it continues from as a preempted request does from
        its own (they count against max_tokens; penalties, seeded positions and the grammar
        follow them; with remote_prefill the writer fills the KV of all but the last). Raises RequestRejected (see check_token_ids, and the scheduler's own limits)."""
        self.check_token_ids(request_id, [*prompt_token_ids, *output_token_ids], params)
        if len(output_token_ids) >= params.max_tokens:
            raise RequestRejected(request_id, f"a replay of {len(output_token_ids)} output tokens needs "
                                              f"max_tokens above them ({params.max_tokens})")
        seq = Sequence(request_id, list(prompt_token_ids), params, priority, cache_salt)
        for token in output_token_ids:
            seq.append_token(token)
        if params.grammar is not None:
            try:  # from the grammar compile_grammar kept on params (a worker's RPC thread): no compile here
                seq.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as e:
                raise RequestRejected(request_id, f"grammar: {e}") from None
        seq.remote_prefill = remote_prefill
        seq.hold_blocks = hold_blocks
        self.scheduler.add(seq)

    def check_token_ids(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """RequestRejected for a token id outside the vocabulary (prompt, stop_token_ids,
        logit_bias keys): an embedding lookup or a bias out of range would fail the whole
        step, every request in it, not just this one."""
        vocab = self.model.cfg.vocab_size
        for what, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(request_id, f"{what}: token id {bad} is not in this model's vocabulary "
                                                  f"[0, {vocab})")

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler for this model's tokenizer, made on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                waiting = self.config.scheduler.max_waiting
                self._grammars = Grammars.from_folder(self.config.model_path, self.model.cfg.vocab_size,
                                                      self.model.cfg.eos_token_ids,
                                                      waiting if waiting is not None else MAX_COMPILE_WAITERS)
            return self._grammars

    def compile_grammar(self, params: SamplingParams, source: str = "", wait_s: float | None = None) -> None:
        """Compile the request's grammar and keep it on `params` (any thread: a worker's RPC
        thread does, so add_request on the loop never compiles). `source`: who asks (the
        request's tenant, never its cache salt, which a client chooses): sources take turns, none with more than half of `max_waiting`
        distinct schemas in flight. Callers waiting for a compile count against `max_waiting` with the
        queued requests. GrammarError (a ValueError) names what is wrong with the schema, or
        that it cost more than its budget; QueueFull if too many wait already or `wait_s`
        passed before its compile began."""
        if params.grammar is None:
            return
        queued = self.scheduler.num_waiting if self.config.scheduler.max_waiting is not None else 0
        try:
            self.grammars.compile(params.grammar, source, wait_s, queued)
        except CompilerBusy as e:
            raise QueueFull(str(e)) from None

    # -- what workers ask of the scheduler and the KV manager --------------------------------

    @property
    def block_size(self) -> int:
        return self.kv_manager.block_size

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks requests can use (the probe's scratch block not counted)."""
        return self.kv_manager.num_total_blocks

    @property
    def kv_pool(self) -> torch.Tensor:
        """The one block-major KV tensor (what a transfer agent registers); rank 0's with
        tensor parallelism (`rank_pools` has every rank's)."""
        return self.kv_cache.pool

    def rank_pools(self) -> list[tuple[torch.Tensor, range]]:
        """Every rank's KV pool with the KV heads it holds, rank 0 first (one entry, every
        head, without tensor parallelism): what a transfer agent registers. A follower's
        pool is memory shared with this process; on CUDA they are not reachable from here
        (RuntimeError)."""
        if self.ranks is None or self.ranks.group_pool is not None:  # one pool: a latent model's group shares it
            return [(self.kv_cache.pool, range(self.config.model.num_kv_heads))]
        if len(self.ranks.pools) != len(self.ranks.layouts) - 1:
            raise RuntimeError("the other ranks' KV pools are not mapped in this process (built without "
                               "share_rank_pools, or CUDA ranks: a CUDA group would need an agent per rank, not "
                               "written yet)")
        pools = [self.kv_cache.pool, *self.ranks.pools]
        return [(pool, layout.kv_heads) for pool, layout in zip(pools, self.ranks.layouts)]

    def stats(self) -> EngineStats:
        sch, kv = self.scheduler, self.kv_manager
        return EngineStats(sch.num_waiting, sch.waiting_tokens, sch.num_running, kv.num_free_blocks,
                           kv.num_total_blocks, kv.block_size, kv.prefix_cache_hit_rate, sch.num_preemptions)

    def record_kv_events(self) -> KVEventBuffer:
        """The prefix cache's stored and removed block hashes from now on (engine/kv_events.py),
        drained by the caller on the engine's thread."""
        return self.kv_manager.record_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache finds now (engine's thread)."""
        return self.kv_manager.cached_hashes()

    def num_cached_tokens(self, prompt_token_ids: list[int], cache_salt: str = "") -> int:
        """Prompt tokens the prefix cache would serve now: the pool's, and the disk tier's
        right after them (counted, not read)."""
        return self.kv_manager.num_cached_tokens(prompt_token_ids, cache_salt)

    @property
    def disk_tier_tokens(self) -> int:
        """Prompt tokens brought into the pool from the disk tier instead of computed, ever
        (a worker observes the increase after each step)."""
        return self.kv_manager.lower_tier_tokens

    def disk_tier_stats(self) -> DiskTierStats | None:
        """The disk tier's state (any thread); None without one."""
        return self.disk_tier.stats() if self.disk_tier is not None else None

    def routed_tokens_per_expert(self) -> list[int] | None:
        """Tokens routed to each expert since the start, summed over the model's mixture-of-
        experts layers (any thread; a read during a step may miss that step); None for a
        dense model."""
        model = self.model
        routed = [layer.moe.routed for layer in model.layers if layer.moe is not None] if model is not None else []
        return torch.stack(routed).sum(0).tolist() if routed else None

    def holds_blocks(self, request_id: str) -> bool:
        """A finished (or aborted) request whose blocks wait for release()."""
        return request_id in self.scheduler.held

    def awaiting_kv(self, request_id: str) -> Sequence | None:
        """The sequence whose blocks are reserved for a remote prefill, if it still waits."""
        return self.scheduler.awaiting_kv.get(request_id)

    def remote_kv_ready(self, request_id: str, first_token: int) -> SequenceUpdate | None:
        """Its KV landed and the prefill worker sampled `first_token`: it decodes from now."""
        return self.scheduler.remote_kv_ready(request_id, first_token)

    def remote_kv_failed(self, request_id: str) -> None:
        """Its remote prefill failed with no write in flight: prefill it here instead."""
        self.scheduler.remote_kv_failed(request_id, recompute=True)

    def keep(self, request_id: str) -> KeptKV | None:
        """End a running request between two decode steps but keep its blocks, held until
        release(), for another worker to copy (a drained decode worker's hand-off); None for
        one that is not running with its KV complete but for the last token."""
        return self.scheduler.keep(request_id)

    def quarantine(self, request_id: str, quarantine_id: str) -> None:
        """Set the request's blocks aside under `quarantine_id` (a writer may not have
        stopped): held until release(quarantine_id); the request goes on without them."""
        self.scheduler.quarantine(request_id, quarantine_id)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished request held (hold_blocks, or aborted awaiting KV)."""
        self.scheduler.release(request_id)

    @torch.inference_mode()
    def probe(self) -> int:
        """A real one-token forward pass and sample (deep health), into a block kept for it."""
        seq = Sequence("__probe__", [self.model.cfg.bos_token_id or 0], SamplingParams(temperature=0, max_tokens=1))
        out = SchedulerOutput([ScheduledChunk(seq, 0, 1, [self._probe_block])])
        return self.runner.execute(out).token_ids["__probe__"]

    @torch.inference_mode()
    def warm_up(self) -> int:
        """One full token budget through the model (a prompt of that many tokens, its KV
        written into the probe's scratch block only), before any request: the longest step
        the scheduler can hand the runner at context 0. Returns the tokens it ran."""
        n = min(self.scheduler.config.max_num_batched_tokens, self.model.cfg.max_model_len)
        bs = self.kv_manager.block_size
        seq = Sequence("__warm_up__", [self.model.cfg.bos_token_id or 0] * n, SamplingParams(temperature=0, max_tokens=1))
        table = [self._probe_block] * -(-n // bs)  # every block of the table is the scratch block
        self.runner.execute(SchedulerOutput([ScheduledChunk(seq, 0, n, table)]))
        return n

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        """Requests not finished: waiting, running, or awaiting remote KV."""
        return len(self.scheduler.requests)

    def num_held(self) -> int:
        """Finished or aborted requests whose blocks wait for release() (a writer's confirmation)."""
        return len(self.scheduler.held)

    def step(self) -> list[RequestOutput]:
        """Schedule and execute one iteration; a delta (new tokens) per request that produced one."""
        return self.execute(self.schedule()).outputs

    def stand_in_forward(self, forward: Callable[[SchedulerOutput], RunnerOutput]) -> None:
        """Run `forward` instead of the model's forward pass and sampling: it gets each step's
        schedule and returns a token for every chunk whose `sample` is set. For measuring what
        surrounds the engine without the model's cost (bench/harness/fixed_time_step.py, a
        GPU step's stand-in); never used to serve."""
        self.runner.execute = forward

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens and blocks (and reserve blocks for remote prefills)."""
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput, between_layers: Callable[[], None] | None = None) -> StepResult:
        """Run the scheduled step: forward, sample, then progress, stops and frees.
        `between_layers`, if given, is called after each decoder layer of this step (a
        worker's chance to make progress on transfers whose peers wait on this process)."""
        if out.is_empty:
            return StepResult([], list(out.preempted), None)
        t0 = time.perf_counter()
        self.model.between_layers = between_layers
        try:
            result = self.runner.execute(out)
        finally:
            self.model.between_layers = None
        seqs = {c.seq.request_id: c.seq for c in out.chunks}
        deltas = []
        logprobs = result.logprobs
        for upd in self.scheduler.update_from_output(out, result.token_ids):
            seq = seqs[upd.request_id]
            lp = logprobs.get(upd.request_id) if logprobs else None
            deltas.append(RequestOutput(upd.request_id, seq.prompt_token_ids, upd.new_token_ids, "",
                                        upd.finish_reason, [lp] if lp is not None else None,
                                        seq.num_cached_tokens))
        stats = StepStats(out.num_tokens, len(out.chunks), time.perf_counter() - t0)
        return StepResult(deltas, list(out.preempted), stats, out.chunks, _kv_written_event(self._on_cuda))


def _kv_written_event(on_cuda: bool) -> object:
    """An event after the work queued so far on the current CUDA stream (None off CUDA)."""
    if not on_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _with_eos(cfg: ModelConfig, extra: frozenset[int]) -> ModelConfig:
    return replace(cfg, eos_token_ids=tuple(sorted(set(cfg.eos_token_ids) | extra)))
