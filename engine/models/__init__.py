"""The model registry: one module per family, each a `Family` (engine/models/family.py) that
says how it reads its config.json and names its checkpoint's tensors. A newcomer adds a
family by adding its module here, listing it in FAMILIES, and its tiny checkpoint to the
tests (bench/harness/tiny_models.py: the tests compare it with transformers)."""

from __future__ import annotations

from engine.models import deepseek, gpt_oss, llama, mixtral, qwen3, qwen3_moe
from engine.models.family import Family, UnsupportedModelError

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY,
                                deepseek.FAMILY)
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}


def family_of(architecture: str) -> Family:
    """The family of one of SUPPORTED_ARCHITECTURES."""
    return _BY_ARCHITECTURE[architecture]


def find_family(architectures: list[str], model_type: str | None = None) -> tuple[Family, str]:
    """The family of the first architecture config.json lists that one reads, and that
    architecture; else UnsupportedModelError naming what it asked for and what is supported."""
    arch = next((a for a in architectures if a in _BY_ARCHITECTURE), None)
    if arch is None:
        raise UnsupportedModelError(f"architecture {architectures or model_type!r} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _BY_ARCHITECTURE[arch], arch
