"""The in-process engine: scheduler + model runner, one `step()` at a time.

    out = scheduler.schedule()          # which tokens of which requests, which blocks
    result = runner.execute(out)        # tensors in, sampled token ids out
    scheduler.update_from_output(...)   # progress, stops, frees
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import RemotePrefill, RequestRejected, ScheduledChunk, Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.weights import load_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        model = CausalLM(config.model, config.dtype, config.device)
        load_weights(model, config.model_path)
        model.prepare()
        num_blocks = config.cache.resolve_num_blocks(config.model.kv_bytes_per_token(config.dtype))
        # One physical block more than the manager hands out: the deep-health probe's scratch.
        self.kv_cache = KVCache(config.model, num_blocks + 1, config.cache.block_size, config.dtype, config.device)
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        eos = frozenset(config.model.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, eos)
        self.runner = ModelRunner(model, self.kv_cache, config.device)
        self.model = model
        self.last_step: StepStats | None = None
        self.last_output: SchedulerOutput | None = None
        self._remote_prefills: list[RemotePrefill] = []
        # Called in step() after scheduling and before the forward pass when the schedule
        # reserved blocks for remote prefills (take_remote_prefills has them), so a worker
        # can start those prefills without waiting for this step's compute.
        self.on_remote_prefills: Callable[[], object] | None = None
        self._probe_block = num_blocks
        log.info("engine ready in %.1fs: %s %s, %d KV blocks of %d tokens (%.0f MiB)",
                 time.perf_counter() - t0, config.model.name, config.dtype, num_blocks,
                 config.cache.block_size, self.kv_cache.total_bytes / 2**20)

    @classmethod
    def from_folder(
        cls,
        path,
        dtype: str | torch.dtype = "auto",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> LLMEngine:
        model_cfg = ModelConfig.from_pretrained(path)
        if eos_token_ids:
            model_cfg = _with_eos(model_cfg, eos_token_ids)
        sched = scheduler or SchedulerConfig(max_model_len=model_cfg.max_model_len)
        if sched.max_model_len > model_cfg.max_model_len:
            raise ValueError(f"max_model_len={sched.max_model_len} exceeds the model's "
                             f"limit of {model_cfg.max_model_len}")
        return cls(EngineConfig(model_cfg, path, resolve_dtype(dtype)[0], cache or CacheConfig(), sched))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, remote_prefill: bool = False, hold_blocks: bool = False,
                    cache_salt: str = "") -> None:
        """Queue a request. remote_prefill: reserve blocks for KV written by a prefill worker
        (see take_remote_prefills); hold_blocks: keep its blocks after it finishes until
        scheduler.release() (a prefill worker pushing them). Raises RequestRejected (see
        check_token_ids, and the scheduler's own limits)."""
        self.check_token_ids(request_id, prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, priority, cache_salt)
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

    def take_remote_prefills(self) -> list[RemotePrefill]:
        """Block reservations made for remote-prefill requests since the last call."""
        taken, self._remote_prefills = self._remote_prefills, []
        return taken

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

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a delta (new tokens) per request that produced one."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self._remote_prefills.extend(out.remote_prefills)
        self.last_output = out
        if out.remote_prefills and self.on_remote_prefills is not None:
            try:
                self.on_remote_prefills()
            except Exception:  # the step goes on (the hook should handle its own failures)
                log.exception("starting remote prefills failed")
        if out.is_empty:
            return []
        result = self.runner.execute(out)
        seqs = {c.seq.request_id: c.seq for c in out.chunks}
        deltas = []
        for upd in self.scheduler.update_from_output(out, result.token_ids):
            seq = seqs[upd.request_id]
            lp = result.logprobs.get(upd.request_id)
            deltas.append(RequestOutput(
                request_id=upd.request_id,
                prompt_token_ids=seq.prompt_token_ids,
                token_ids=upd.new_token_ids,
                finish_reason=upd.finish_reason,
                logprobs=[lp] if lp is not None else None,
                num_cached_tokens=seq.num_cached_tokens,
            ))
        self.last_step = StepStats(out.num_tokens, len(out.chunks), time.perf_counter() - t0)
        return deltas


def _with_eos(cfg: ModelConfig, extra: frozenset[int]) -> ModelConfig:
    return replace(cfg, eos_token_ids=tuple(sorted(set(cfg.eos_token_ids) | extra)))
