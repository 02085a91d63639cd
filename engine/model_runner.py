"""Turns a SchedulerOutput into tensors, runs the model, samples, and hands back plain lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillSpan, build_decode_mask
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampler import Sampler, SamplingMetadata, TokenLogprobs
from engine.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    token_ids: dict[str, int]  # request id -> sampled token, for chunks that sample
    logprobs: dict[str, TokenLogprobs]  # only for requests that asked for logprobs


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, sample_rows = self._prepare(out)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)  # [num_tokens, hidden]
        sampled = [c for c in out.chunks if c.sample]
        if not sampled:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampled, vocab]
        smeta = SamplingMetadata.build(
            [c.seq.params for c in sampled],
            [c.seq.prompt_token_ids for c in sampled],
            [c.seq.output_token_ids for c in sampled],
            logits.shape[-1],
            self.device,
        )
        result = self.sampler(logits, smeta)
        ids = [c.seq.request_id for c in sampled]
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs)

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos_parts, block_parts, prefills = [], [], []
        decode_tables, decode_lens = [], []
        sample_rows = []
        offset = 0
        for chunk in out.chunks:
            n = chunk.num_new
            ids.extend(chunk.token_ids)
            pos = torch.arange(chunk.start, chunk.start + n)
            table = torch.tensor(chunk.block_table, dtype=torch.int64)
            pos_parts.append(pos)
            block_parts.append(table[pos // bs])
            if n == 1:
                decode_tables.append(chunk.block_table)
                decode_lens.append(chunk.context_len)
            else:
                prefills.append(PrefillSpan(offset, n, chunk.context_len, table))
            offset += n
            if chunk.sample:
                sample_rows.append(offset - 1)
        positions = torch.cat(pos_parts)
        num_decodes = len(decode_tables)
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.zeros(num_decodes, width, dtype=torch.int64)
        for i, t in enumerate(decode_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_blocks=torch.cat(block_parts).to(self.device),
            slot_offsets=(positions % bs).to(self.device),
            num_decodes=num_decodes,
            decode_block_tables=tables.to(self.device),
            decode_mask=build_decode_mask(torch.tensor(decode_lens, dtype=torch.int64), width * bs).to(self.device),
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta, torch.tensor(sample_rows, dtype=torch.int64)
