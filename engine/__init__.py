"""pdserve's engine: a Llama-family model on a paged KV cache with continuous batching.

`LLM` and `SamplingParams` are the offline API; the workers build on `LLMEngine`. What the
gateway, rpc and deploy need without torch is in common/, below this package.
"""

from __future__ import annotations

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
