"""The Triton op set: what `kernels.get_ops` returns on CUDA (and on CPU, in Triton's
interpreter, when PDSERVE_KERNELS=triton). Each op has the signature of its namesake in
`kernels.reference`, plus an optional `out=` so tests can poison the output first.
"""

from __future__ import annotations

from kernels.kv_copy import pack_blocks, unpack_blocks, write_kv
from kernels.norm_rope import add_rms_norm, rms_norm, rotary
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.reference import argmax, silu_mul  # torch's own on the GPU; silu_mul: one fused op pair
from kernels.sampling import sample, sampling_mask
from kernels.triton_util import INTERPRET

NAME = "triton"
BATCHED = True  # attention and sampling take the whole step in one call each

__all__ = [
    "BATCHED", "INTERPRET", "NAME", "add_rms_norm", "argmax", "pack_blocks", "paged_decode_attention",
    "paged_prefill_attention", "rms_norm", "rotary", "sample", "sampling_mask", "silu_mul", "unpack_blocks",
    "write_kv",
]
