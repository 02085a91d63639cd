"""Linear layers with weights pre-packed once on CPU, for the small-M matmuls of decoding.

Packing happens after the weights are loaded, where the host can. Where the native library
is loaded, the weight is packed for a native small-batch kernel: bf16 on AMX tiles
(kernels/csrc/amx_bf16.cpp) or AVX512-BF16 dots (gemv_bf16.cpp), which stream the weights
closer to memory bandwidth than oneDNN does at decode batch sizes; float32 on FMA register
tiles (gemm_f32.cpp), AVX-512 or AVX2; and bf16 on the same tiles where the CPU has no bf16
dot product (weights widened in registers). bf16 weights are also packed in oneDNN's
blocked layout (1.5-2.5x `F.linear` on an AVX-512/AMX CPU, bench/RESULTS.md) where oneDNN
runs bf16 natively; not where it would emulate the dots (the FMA tiles are faster there).
`linear` takes the native kernel up to MAX_ROWS[kernel] rows, oneDNN above where it is
packed, else the native kernel in slices; once the packed copies serve every x the model
drops the unpacked weight (a float32 SmolLM2 worker: ~0.4 GiB less). CUDA tensors and a
CPU with neither kernel keep `F.linear`. The choices and their reasons are logged once per
process.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.host import cpu, log_choice

# Rows of x up to which each native kernel beats the matmul it replaces (SmolLM2's shapes,
# a model's worth of distinct weights, bench/RESULTS.md). AMX host: AMX vs oneDNN 1.5x at
# 1-32 rows, 1.15x at 64, 1.05x at 128. AVX512-BF16 host without AMX (AMD Zen 5): dots
# (register tiles above 8 rows) vs oneDNN 1.33x at 8 rows, 1.42x at 32, 1.15x at 256,
# 1.10x at 512 (prefill chunks too). float32 FMA tiles vs F.linear 1.04x at 1, 2x at 4-8,
# 1.4x at 32, 1.13x at 256 (AMX host); 1.47x at 256 and 512 on AMD Zen 5, where F.linear's
# fp32 GEMM runs at ~0.6x of the FMA peak (prefill chunks: the default token budget).
# bf16 FMA tiles (no bf16 hardware) vs oneDNN's emulated bf16: 1.5x at 1 row, 4x at 16-256,
# 3.6x at 512 (Intel AVX-512 without AVX512-BF16): they take every row count, in slices.
MAX_ROWS = {"amx": 128, "dots": 512, "f32": 512, "fma_bf16": 512}


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the layouts this host's matmuls read; None where one does not apply."""

    onednn: torch.Tensor | None  # oneDNN's blocked layout (bf16)
    native: torch.Tensor | None  # native.pack_matmul_weight's layout for `kernel`
    library: ctypes.CDLL | None  # the native library that runs `kernel`
    kernel: str | None = None  # a key of native.MATMULS

    @property
    def native_rows(self) -> int:
        """The most rows of x the native kernel takes in one call (0: none); more go to
        oneDNN where it is packed, else to the native kernel in slices of this many."""
        return MAX_ROWS[self.kernel] if self.native is not None else 0

    @property
    def serves_every_x(self) -> bool:
        """Whether these copies take any x of the weight's dtype, so that the unpacked
        weight need not be kept beside them: oneDNN's, or a native kernel that refuses
        nothing it was packed for (AMX can: its tiles need K % 32 and the OS's permission)."""
        return self.onednn is not None or self.kernel in ("f32", "fma_bf16", "dots")


def native_kernel(dtype: torch.dtype) -> tuple[str | None, str]:
    """The native small-batch matmul for `dtype` on this CPU (a key of native.MATMULS, or
    None), and why."""
    caps = cpu()
    if dtype == torch.bfloat16:
        if caps.amx_bf16:
            return "amx", "this CPU has AMX-BF16"
        if caps.avx512_bf16:
            return "dots", "this CPU has AVX512-BF16 (no AMX)"
        if native.isa_level() != "generic":
            return "fma_bf16", f"no bf16 dot product on this CPU ({caps.isa}): bf16 widened onto FMA tiles"
        return None, f"no bf16 dot product and no AVX2 or AVX-512 on this CPU ({caps.isa})"
    if dtype == torch.float32:
        if native.isa_level() == "generic":
            return None, "no AVX2 or AVX-512 on this CPU"
        return "f32", f"FMA tiles on {native.isa_level()}"
    return None, f"no native matmul for {dtype}"


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
    `library`: the native library (the native op set's `matmul_library()`), for the small-batch kernels."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    kernel, why = native_kernel(weight.dtype)
    packed = native.pack_matmul_weight(weight, kernel) if library is not None and kernel is not None else None
    dtype = str(weight.dtype).removeprefix("torch.")
    if packed is not None:
        rows = "at every row count" if kernel == "fma_bf16" else f"up to {MAX_ROWS[kernel]} rows"
        log_choice(f"{dtype} linear at decode batch sizes", f"native {kernel} kernel {rows}", why)
    elif library is not None:
        log_choice(f"{dtype} linear at decode batch sizes", "no native kernel", why)
    onednn = None
    # Without bf16 dots in hardware oneDNN emulates them, slower than the FMA tiles at every
    # row count (MAX_ROWS above): no second copy for it then.
    if weight.dtype == torch.bfloat16 and not (packed is not None and kernel == "fma_bf16"):
        ok, why = packing_supported()
        if ok:
            try:
                onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            except (AttributeError, RuntimeError) as e:
                ok, why = False, f"oneDNN refused to pack ({str(e).splitlines()[0][:120]})"
        log_choice("bf16 linear", "oneDNN packed weights" if ok else "F.linear", why)
    if onednn is None and packed is None:
        return None
    return PackedWeight(onednn, packed, library if packed is not None else None, kernel if packed is not None else None)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x @ weight.T + bias on the fastest copy of the weight for x's row count. `weight` may
    be None once `packed.serves_every_x` (the model releases it after packing)."""
    if packed is not None:
        if packed.native is not None and (x.shape[0] <= packed.native_rows or packed.onednn is None):
            out = _native_slices(x, bias, packed)
            if out is not None:
                return out
        if packed.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    if weight is None:
        raise ValueError(f"linear: no packed copy takes x of shape {tuple(x.shape)}, {x.dtype}, strides {x.stride()} "
                         "and the unpacked weight was released")
    return F.linear(x, weight, bias)


def _native_slices(x: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor | None:
    rows = packed.native_rows
    if x.dim() == 2 and x.stride(-1) != 1:  # the kernels read rows of contiguous columns
        x = x.contiguous()
    if x.shape[0] <= rows:
        return native.matmul(packed.library, x, packed.native, bias, packed.kernel)
    parts = [native.matmul(packed.library, x[i:i + rows], packed.native, bias, packed.kernel)
             for i in range(0, x.shape[0], rows)]
    return None if any(part is None for part in parts) else torch.cat(parts)
