"""Linear layers with weights pre-packed for oneDNN on CPU (bf16).

oneDNN's blocked weight layout makes the small-M matmuls of decoding 1.5-2.5x faster
than plain `F.linear` on an AVX-512/AMX CPU (measured in bench/RESULTS.md). Packing is
done once after the weights are loaded, where the host can: oneDNN's bf16 needs
AVX-512 (avx512bw/vl/dq), so an AVX2-only CPU keeps `F.linear`, as do fp32, CUDA and a
torch without oneDNN. The choice and its reason are logged once per process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.host import cpu, log_choice

_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this M; measured flat for M in 1..512


def packing_supported() -> tuple[bool, str]:
    """Whether bf16 weights are packed for oneDNN on this host's CPU, and why."""
    caps = cpu()
    if not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN"
    if not caps.onednn_bf16:
        return False, f"oneDNN's bf16 needs AVX-512 and this CPU has {caps.isa}"
    return True, f"oneDNN runs bf16 on this CPU ({caps.isa})"


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] weight, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    ok, why = packing_supported()
    if ok:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        except (AttributeError, RuntimeError) as e:
            ok, why, packed = False, f"oneDNN refused to pack ({str(e).splitlines()[0][:120]})", None
    log_choice("bf16 linear", "oneDNN packed weights" if ok else "F.linear", why)
    return packed if ok else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
