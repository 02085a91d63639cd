"""The CPU op set with native kernels where they win: the torch ops of kernels.reference,
but decode and prefill attention read K/V in place through the block tables
(kernels/native.py, kernels/csrc/paged_decode.cpp, paged_prefill.cpp) instead of gathering
every block into a copy first, and
RMS norm (with its residual add), rotary and SiLU-and-multiply are one pass each
(kernels/csrc/norm_act.cpp) instead of a chain of torch ops, and greedy rows take their
argmax natively (greedy.cpp: ~8x torch's on a batch-32 step's logits). Any tensor a kernel does not
take (float64 in tests, odd widths) runs the reference op.

`kernels.get_ops` returns this module on CPU with PDSERVE_KERNELS=native (an error if the
library cannot be built here). DECODE_IN_PLACE tells engine/attention.py to call
`paged_decode_attention` with context lengths, one call over all the step's decodes;
PREFILL_IN_PLACE, `paged_prefill_attention` once over all the step's prefill chunks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native, reference
from kernels.reference import (  # noqa: F401  (the rest of the op set, unchanged)
    decode_attention,
    gather_context,
    pack_blocks,
    prefill_attention,
    sample,
    sampling_mask,
    unpack_blocks,
    write_kv,
)

__all__ = ["NAME", "BATCHED", "DECODE_IN_PLACE", "PREFILL_IN_PLACE", "init", "library", "paged_decode_attention", "add_rms_norm",
           "argmax",
           "decode_attention", "gather_context", "pack_blocks", "paged_prefill_attention", "prefill_attention",
           "rms_norm", "rotary", "sample", "sampling_mask", "silu_mul", "unpack_blocks", "write_kv"]

NAME = "native"
BATCHED = False
DECODE_IN_PLACE = True
PREFILL_IN_PLACE = True

_lib = None


def library():
    """The loaded native library (for kernels.linear's small-batch matmul)."""
    return _lib


def init(cache_dir: Path) -> None:
    """Build (or find) and load the library; raises native.NativeUnavailable."""
    global _lib
    _lib = native.load(cache_dir)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.paged_decode_attention; natively in float32 and bfloat16 (the
    dtypes served), by the reference in any other (float64 in tests)."""
    if q.dtype in native.DTYPES:
        return native.paged_decode_attention(_lib, q, k_cache, v_cache, block_tables, context_lens, scale, out=out)
    result = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor, max_seqlen_q: int, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.paged_prefill_attention; natively where the kernel serves the
    shapes (float32 / bfloat16, head_dim 64 or 128, a vector ISA), else by the reference."""
    done = native.paged_prefill_attention(_lib, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                          out=out)
    if done is not None:
        return done
    result = reference.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                               max_seqlen_q, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    done = native.rms_norm(_lib, x, weight, eps)
    return reference.rms_norm(x, weight, eps) if done is None else done[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    done = native.rms_norm(_lib, x, weight, eps, residual=residual)
    return reference.add_rms_norm(x, residual, weight, eps) if done is None else done


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    done = native.rotary(_lib, x, cos, sin)
    return reference.rotary(x, cos, sin) if done is None else done


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    done = native.silu_mul(_lib, x)
    return reference.silu_mul(x) if done is None else done


def argmax(x: torch.Tensor) -> torch.Tensor:
    done = native.argmax(_lib, x)
    return reference.argmax(x) if done is None else done
