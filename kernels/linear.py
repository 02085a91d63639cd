"""Linear layers with weights pre-packed for oneDNN on CPU (bf16).

oneDNN's blocked weight layout makes the small-M matmuls of decoding 1.5-2.5x faster
than plain `F.linear` on this CPU (measured in bench/RESULTS.md). Packing is done once
after the weights are loaded; anything else (fp32, CUDA, a torch without oneDNN) keeps
`F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this M; measured flat for M in 1..512


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] weight, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
