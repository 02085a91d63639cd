"""pdserve's engine: a Llama-family model on a paged KV cache with continuous batching.

`LLM` and `SamplingParams` are the offline API; the workers build on `LLMEngine`.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: importing `engine` for its light parts (block hashes, params) must not load torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
