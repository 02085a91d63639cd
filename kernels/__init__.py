"""Compute kernels behind one dispatch point.

`get_ops(device)` returns the op set the model calls for paged attention. On CPU that is
the torch reference implementation in `kernels.reference`; a CUDA build plugs Triton
kernels in here (each beside its reference) without the model changing.
"""

from __future__ import annotations

from types import ModuleType

import torch


def get_ops(device: torch.device | str) -> ModuleType:
    """The kernel module for `device` (functions: write_kv, decode_attention, prefill_attention)."""
    from kernels import reference

    return reference
