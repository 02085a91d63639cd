"""Compute kernels behind one dispatch point.

`get_ops(device)` returns the op set the model, attention and sampler call: on CPU
`kernels.native_ops.OPS` (the torch ops of `kernels.reference`, with decode and prefill
attention and the row-wise ops by native kernels built for this host's ISA: faster at every shape measured,
bench/RESULTS.md), or `kernels.reference.OPS` where no compiler can build them (logged);
on CUDA the Triton kernels of `kernels.triton_ops.OPS` (one module per concept beside them:
paged_attention, kv_copy, norm_rope, sampling). `kernels.reference` is also every
kernel's oracle. PDSERVE_KERNELS (common/envs.py; PDSERVE_CACHE_DIR says
where the native library is cached) overrides the choice: `torch` takes the references
everywhere, `triton` the Triton kernels everywhere (on CPU they run in Triton's
interpreter: slow, for tests), `native` requires the native op set (an error without it).

An op set is an `OpSet` (kernels/op_set.py: every method with its shapes), one class per
backend: `reference.TorchOps`, `native_ops.NativeOps`, `triton_ops.TritonOps`, each module's
`OPS`. How a backend takes a step's attention (padded groups, in place, batched) and its
sampling (the engine's torch stages or one kernel) is behind `plan_decodes`,
`attention_step` and `sample_step`; kernels.reference's module functions are also every
kernel's oracle.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from common import envs
from kernels.host import log_choice
from kernels.op_set import OpSet

log = logging.getLogger(__name__)

def kernel_choice() -> str:
    """PDSERVE_KERNELS: `auto` (default: Triton on CUDA, native on CPU where it builds, else
    torch), `torch`, `triton` or `native` (CPU: the native op set, or an error)."""
    return envs.kernels()


def get_ops(device: torch.device | str) -> OpSet:
    """The op set for tensors on `device` (see the module docstring)."""
    choice = kernel_choice()
    device = torch.device(device)
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"PDSERVE_KERNELS=native is for CPU tensors, not {device.type}")
        native = _native_ops(choice)
        if native is not None:
            return native
        if choice == "native":
            raise RuntimeError("PDSERVE_KERNELS=native, but the native kernels cannot be built here (see the log)")
    if choice in ("torch", "auto") and device.type != "cuda":
        from kernels import reference

        log_choice(f"kernels on {device.type}", "torch ops (kernels.reference)",
                   "PDSERVE_KERNELS=torch" if choice == "torch" else "the native kernels cannot be built here")
        return reference.OPS
    ops = _triton_ops(device)
    log_choice(f"kernels on {device.type}", "Triton" + (" (interpreter)" if device.type == "cpu" else ""),
               "PDSERVE_KERNELS=triton" if choice == "triton" else "a CUDA device")
    return ops


@functools.cache
def _native_ops(choice: str) -> OpSet | None:
    """The native op set, its library built for this host (once per process), or None
    with the reason logged."""
    from kernels import native, native_ops

    try:
        native_ops.init(envs.cache_dir())
    except (native.NativeUnavailable, OSError) as e:
        log.warning("the native kernels are unavailable: %s", e)
        return None
    log_choice("kernels on cpu", f"native kernels ({native.isa_level()}) + torch ops",
               "PDSERVE_KERNELS=native" if choice == "native" else "a C++ compiler built them for this CPU")
    return native_ops.OPS


def _triton_ops(device: torch.device) -> OpSet:
    if device.type == "cpu":
        # The interpreter must be on before the kernels are defined (at their first import).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from kernels import triton_ops
    except ImportError as e:
        raise RuntimeError(f"the Triton kernels need the `triton` package ({e}); install it "
                           "(pip install 'triton>=3.5') or set PDSERVE_KERNELS=torch") from e
    if device.type == "cpu" and not triton_ops.INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors run only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before kernels.triton_ops is first imported")
    return triton_ops.OPS
