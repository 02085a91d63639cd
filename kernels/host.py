"""What this host's CPU can do, detected at run time, and the choices that follow from it.

pdserve runs on more than one kind of x86 host: Intel with AVX-512, AVX512-BF16 and AMX
computes bf16 natively (and oneDNN packs bf16 weights); an AVX2-only CPU (AMD Zen 3, say)
has no bf16 arithmetic, so its bf16 matmuls widen bf16 to float32 on FMA tiles, which may
be faster or slower than float32 there. `auto_dtype` below is the rule by capability
alone; `dtype="auto"` (the default everywhere; engine/config.py resolves it) takes bf16
where it is native and measures the two dtypes elsewhere (kernels/dtype_choice.py).
Every choice is logged once with its reason, and `describe()` names the host beside
figures.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CpuCapabilities:
    model_name: str  # as /proc/cpuinfo names it
    torch_isa: str  # torch's own dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    avx512: bool
    avx512_bf16: bool
    amx_bf16: bool
    onednn_bf16: bool  # oneDNN runs bf16 here (its weight packing works)

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX-BF16), not emulated."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def isa(self) -> str:
        """The best matmul ISA, for names beside figures: AMX-BF16, AVX512-BF16, AVX512, AVX2..."""
        if self.amx_bf16:
            return "AMX-BF16"
        if self.avx512_bf16:
            return "AVX512-BF16"
        return self.torch_isa

    def describe(self) -> str:
        return f"{self.model_name} ({self.isa}; torch {self.torch_isa}, {torch.get_num_threads()} threads)"


@functools.cache
def cpu() -> CpuCapabilities:
    """This host's CPU, read once per process."""
    flags: set[str] = set()
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and not name:
                name = value.strip()
    except OSError:  # not Linux: what torch says is all we know
        pass
    name = name or platform.machine()
    torch_isa = torch.backends.cpu.get_cpu_capability()
    try:
        onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = False
    return CpuCapabilities(name, torch_isa, "avx512f" in flags or torch_isa.startswith("AVX512"),
                           "avx512_bf16" in flags, "amx_bf16" in flags, onednn_bf16)


def auto_dtype(device: str = "cpu") -> tuple[torch.dtype, str]:
    """The dtype by capability alone, and why: bf16 where it is native, else float32 (the
    choice with nothing measured; kernels/dtype_choice.py measures where it is not native)."""
    if device != "cpu":
        return torch.bfloat16, f"{device} computes bf16 natively"
    caps = cpu()
    if caps.native_bf16:
        return torch.bfloat16, f"this CPU computes bf16 natively ({caps.isa})"
    return torch.float32, f"this CPU has no native bf16 ({caps.isa}) and nothing was measured"


@functools.cache
def log_choice(what: str, choice: str, reason: str) -> None:
    """Name a choice made by capability (a dtype, a kernel path) with its reason, once per process."""
    log.info("%s: %s, because %s [host: %s]", what, choice, reason, cpu().describe())
