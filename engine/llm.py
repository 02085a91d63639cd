"""The offline API, like vLLM's `LLM`: many prompts in, continuous batching, outputs back.

    from engine import LLM, SamplingParams
    llm = LLM(model="smollm2")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence

import torch

from common.detokenizer import IncrementalDetokenizer
from common.model_source import resolve_model
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kernels.host import cpu

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float = 1.0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        tensor_parallel_size: int = 1,
    ):
        """`tensor_parallel_size`: ranks the model is sharded over, one process each (this one
        is rank 0 and schedules and samples; CPU and gloo only so far: engine/parallel/).
        `num_threads` is each rank's. A degree the model's head counts do not divide is
        refused with the degrees that would work. `close()` stops the other ranks."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        path = resolve_model(model)
        self.tokenizer = Tokenizer.from_pretrained(path)
        cache = CacheConfig(block_size, num_kv_blocks, kv_cache_memory_gib, enable_prefix_caching)
        limit = ModelConfig.from_pretrained(path).max_model_len
        sched = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len or limit)
        resolved, why = resolve_dtype(dtype)
        self.dtype_choice = f"dtype {str(resolved).removeprefix('torch.')}, because {why} [{cpu().describe()}]"
        self.engine = LLMEngine.from_folder(path, resolved, cache, sched, self.tokenizer.eos_token_ids,
                                            tensor_parallel_size)
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate the assistant's reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.chat_prompt_ids(c) for c in convs]
        return self._run(token_lists, params, use_tqdm)

    def chat_prompt_ids(self, messages: Messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Generate one request and yield its text as it is produced (UTF-8 safe)."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt_token_ids, params)
        detok = IncrementalDetokenizer(self.tokenizer)
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        if text := detok.step(delta.token_ids):
                            yield text
            if tail := detok.flush():
                yield tail
        finally:
            self.engine.abort_request(rid)

    def _run(self, token_lists: list[list[int]], params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        outputs: dict[str, RequestOutput] = {}
        added = []
        try:
            for ids, p in zip(token_lists, params):
                rid = f"req-{next(self._ids)}"
                self.engine.add_request(rid, ids, p)
                added.append(rid)
                outputs[rid] = RequestOutput(rid, ids, logprobs=[] if p.logprobs is not None else None)
            bar = _progress(len(added)) if use_tqdm else None
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    o = outputs[delta.request_id]
                    o.token_ids.extend(delta.token_ids)
                    o.num_cached_tokens = delta.num_cached_tokens
                    if delta.logprobs and o.logprobs is not None:
                        o.logprobs.extend(delta.logprobs)
                    if delta.finish_reason is not None:
                        o.finish_reason = delta.finish_reason
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        finally:
            for rid in added:  # an exception (or Ctrl-C) mid-run must not leave requests behind
                self.engine.abort_request(rid)
        for o in outputs.values():
            o.text = self.tokenizer.decode(o.token_ids)
        return [outputs[rid] for rid in added]


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr, unit="req")
