"""The CPU op set with native kernels where they win (`NativeOps`): the torch ops of
kernels.reference, but decode and prefill attention read K/V in place through the block
tables (kernels/native.py, kernels/csrc/paged_decode.cpp, paged_prefill.cpp) instead of
gathering every block into a copy first, and
RMS norm (with its residual add), rotary and SiLU-and-multiply are one pass each
(kernels/csrc/norm_act.cpp) instead of a chain of torch ops, and greedy rows take their
argmax natively (greedy.cpp: ~8x torch's on a batch-32 step's logits). Any tensor a kernel does not
take (float64 in tests, odd widths) runs the reference op.

`kernels.get_ops` returns `OPS` on CPU where the library builds (with PDSERVE_KERNELS=native,
an error if it cannot). Reading in place, a step's decodes are one group (each row read up
to its own context length: no padding to pay for) and its prefill chunks one varlen call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kernels import native, reference
from kernels.attention_step import AttentionMetadata, DecodeGroup, StepDecodes, VarlenMetadata

_lib = None  # the loaded library (`init`)


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


class NativeOps(reference.TorchOps):
    """kernels.reference.TorchOps with the native kernels above; decodes in one group, read in
    place, and every prefill chunk in one call."""

    name = "native"
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotary = staticmethod(rotary)
    silu_mul = staticmethod(silu_mul)
    argmax = staticmethod(argmax)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)

    def plan_decodes(self, decodes: StepDecodes, device: torch.device | str) -> list[DecodeGroup]:
        return [decodes.group(0, len(decodes), device)] if len(decodes) else []

    def attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
        parts = [self.paged_decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.context_lens,
                                             scale) for g in meta.decodes]
        if meta.prefills:  # every chunk in one call
            vm = VarlenMetadata.of(meta)
            parts.append(self.paged_prefill_attention(q[vm.num_decodes:], k_cache, v_cache, vm.prefill_cu_seqlens,
                                                      vm.prefill_context_lens, vm.prefill_block_tables,
                                                      vm.max_prefill_len, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def matmul_library(self) -> Any | None:
        return _lib


OPS = NativeOps()
