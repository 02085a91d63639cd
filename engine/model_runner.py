"""Turns a SchedulerOutput into tensors, runs the model, samples, and hands back plain lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.token_logprobs import TokenLogprobs
from engine.attention import step_attention
from engine.grammar import allowed_next
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler import SchedulerOutput
from engine.step_buffers import StepBuffers, StepLimits
from kernels.attention_step import AttentionMetadata, PrefillSpan


@dataclass
class PreparedStep:
    """A step's flat batch, ready for the forward pass: decodes (ascending context length)
    first, then prefill chunks. Every rank of a tensor-parallel group prepares the same one
    from the same schedule (engine/parallel/follower.py)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attention: AttentionMetadata  # where each token's KV goes and what each query reads
    sample_rows: torch.Tensor  # [num_sampled] int64: the rows whose logits are sampled
    sampled: list  # the chunks those rows belong to, in the same order


@dataclass
class RunnerOutput:
    token_ids: dict[str, int]  # request id -> sampled token, for chunks that sample
    logprobs: dict[str, TokenLogprobs]  # only for requests that asked for logprobs


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: str = "cpu", limits: StepLimits | None = None):
        """`limits`: the scheduler's bounds, to size the step buffers once (default: grown
        to the first steps' sizes)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler()
        self.buffers = StepBuffers(limits or StepLimits(max_tokens=256, max_seqs=16, max_blocks=64), self.block_size)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        step = self.prepare(out)
        sampled = step.sampled
        logits = self.forward(step)
        if logits is None:
            return RunnerOutput({}, {})
        smeta = SamplingMetadata.build(
            [c.seq.params for c in sampled],
            [c.seq.prompt_token_ids for c in sampled],
            [c.seq.output_token_ids for c in sampled],
            logits.shape[-1],
            self.device,
            _grammar_masks(sampled, logits.shape[-1]),
        )
        result = self.sampler(logits, smeta)
        ids = [c.seq.request_id for c in sampled]
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs)

    def forward(self, step: PreparedStep) -> torch.Tensor | None:
        """The model over the step and the LM head over its sampled rows ([num_sampled,
        vocab]; None when no row is sampled): what every tensor-parallel rank runs."""
        # [num_tokens, hidden]
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.layers, step.attention)
        if not step.sampled:
            return None
        return self.model.compute_logits(hidden[step.sample_rows])

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The step's tensors, from its schedule (or a follower rank's StepPlan, which reads
        the same): decodes (ascending context length) first, then prefill chunks."""
        bs = self.block_size
        decodes = sorted((c for c in out.chunks if c.num_new == 1), key=lambda c: c.context_len)
        prefills = [c for c in out.chunks if c.num_new > 1]
        ids = [c.token_ids[0] for c in decodes]
        positions = [c.start for c in decodes]
        slot_blocks = [c.block_table[c.start // bs] for c in decodes]
        sample_rows = [i for i, c in enumerate(decodes) if c.sample]
        sampled = [c for c in decodes if c.sample]
        spans = []
        offset = len(decodes)
        for c in prefills:
            table = torch.tensor(c.block_table, dtype=torch.int64)
            pos = range(c.start, c.start + c.num_new)
            ids.extend(c.token_ids)
            positions.extend(pos)
            slot_blocks.extend(c.block_table[p // bs] for p in pos)
            spans.append(PrefillSpan(offset, c.num_new, c.context_len, table.to(self.device)))
            offset += c.num_new
            if c.sample:
                sample_rows.append(offset - 1)
                sampled.append(c)
        step = self.buffers.fill(ids, positions, slot_blocks, [c.block_table for c in decodes],
                                 [c.context_len for c in decodes])
        meta = step_attention(self.model.ops, step, [len(c.block_table) for c in decodes],
                              [c.context_len for c in decodes], spans, bs, self.device)
        return PreparedStep(step.input_ids.to(self.device), step.positions.to(self.device), meta,
                            torch.tensor(sample_rows, dtype=torch.int64), sampled)


def _grammar_masks(sampled: list, vocab_size: int) -> tuple[list[int], torch.Tensor] | None:
    """(rows, allowed tokens) for the sampled rows under a grammar; None when no row is."""
    rows = [i for i, c in enumerate(sampled) if c.seq.matcher is not None]
    if not rows:
        return None
    masks = allowed_next([sampled[i].seq.matcher for i in rows], [sampled[i].seq.output_token_ids for i in rows],
                         vocab_size)
    if masks is None:
        return None
    constrained, allowed = masks
    return [rows[j] for j in constrained], allowed
