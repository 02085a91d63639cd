"""Linear layers with weights pre-packed on CPU (bf16).

oneDNN's blocked weight layout makes the small-M matmuls of decoding 1.5-2.5x faster
than plain `F.linear` on an AVX-512/AMX CPU (measured in bench/RESULTS.md). Packing is
done once after the weights are loaded, where the host can: oneDNN's bf16 needs
AVX-512 (avx512bw/vl/dq), so an AVX2-only CPU keeps `F.linear`, as do fp32, CUDA and a
torch without oneDNN. Where the native library is loaded and the CPU has AMX-BF16 (or
at least AVX512-BF16), the weight is also packed for the native small-batch kernels
(kernels/csrc/amx_bf16.cpp, gemv_bf16.cpp), which stream the weights closer to memory
bandwidth than oneDNN does at decode batch sizes: `linear` takes them up to
AMX_MAX_ROWS (GEMV_MAX_ROWS without AMX) rows, oneDNN above. The choices and their
reasons are logged once per process.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.host import cpu, log_choice

# Rows of x up to which the native kernels beat oneDNN (AMX host, SmolLM2's shapes, a
# model's worth of distinct weights, bench/RESULTS.md): the AMX one 1.5x at 1-32 rows,
# 1.15x at 64, 1.05x at 128; the AVX512-BF16 one 1.24x at 1 row, ~1.05x at 2-8, 0.75x at 16.
AMX_MAX_ROWS = 128
GEMV_MAX_ROWS = 8


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 weight in the layouts this host's matmuls read; None where one does not apply."""

    onednn: torch.Tensor | None  # oneDNN's blocked layout
    gemv: torch.Tensor | None  # native.pack_gemv_weight's layout, read by both native kernels
    library: ctypes.CDLL | None  # the native library that runs `gemv`
    amx: bool = False  # run `gemv` on AMX tiles (else AVX512-BF16 dot instructions)

    @property
    def native_rows(self) -> int:
        """The most rows of x the native kernel takes (0: none)."""
        if self.gemv is None:
            return 0
        return AMX_MAX_ROWS if self.amx else GEMV_MAX_ROWS

_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this M; measured flat for M in 1..512


def packing_supported() -> tuple[bool, str]:
    """Whether bf16 weights are packed for oneDNN on this host's CPU, and why."""
    caps = cpu()
    if not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN"
    if not caps.onednn_bf16:
        return False, f"oneDNN's bf16 needs AVX-512 and this CPU has {caps.isa}"
    return True, f"oneDNN runs bf16 on this CPU ({caps.isa})"


def pack_weight(weight: torch.Tensor, library: ctypes.CDLL | None = None) -> PackedWeight | None:
    """The packed copies of a [out, in] weight, or None where packing does not apply.
    `library`: the native library (kernels.native_ops.library()), for the small-batch kernel."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    ok, why = packing_supported()
    onednn = None
    if ok:
        try:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        except (AttributeError, RuntimeError) as e:
            ok, why = False, f"oneDNN refused to pack ({str(e).splitlines()[0][:120]})"
    log_choice("bf16 linear", "oneDNN packed weights" if ok else "F.linear", why)
    caps, gemv = cpu(), None
    if library is not None and (caps.amx_bf16 or caps.avx512_bf16):
        gemv = native.pack_gemv_weight(weight)
    if gemv is not None:
        kind = "AMX tiles" if caps.amx_bf16 else "AVX512-BF16 dots"
        log_choice("bf16 linear at decode batch sizes",
                   f"native kernel on {kind} up to {AMX_MAX_ROWS if caps.amx_bf16 else GEMV_MAX_ROWS} rows",
                   f"this CPU has {'AMX-BF16' if caps.amx_bf16 else 'AVX512-BF16'} and the native library is loaded")
    if onednn is None and gemv is None:
        return None
    return PackedWeight(onednn, gemv, library if gemv is not None else None, amx=gemv is not None and caps.amx_bf16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    if packed is not None:
        if x.shape[0] <= packed.native_rows:
            out = native.gemv_bf16(packed.library, x, packed.gemv, bias, amx=packed.amx)
            if out is not None:
                return out
        if packed.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)
