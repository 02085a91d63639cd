"""The Triton op set (`TritonOps`): what `kernels.get_ops` returns on CUDA (and on CPU, in
Triton's interpreter, when PDSERVE_KERNELS=triton). Each op has the signature of its
namesake in `kernels.reference`, plus an optional `out=` so tests can poison the output
first. A step's attention is two launches (every decode, every prefill chunk) into one
output, and its sampling one kernel over the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.attention_step import AttentionMetadata, DecodeGroup, StepDecodes, VarlenMetadata
from kernels.kv_copy import pack_blocks, unpack_blocks, write_kv
from kernels.norm_rope import add_rms_norm, rms_norm, rotary
from kernels.fused_moe import fused_experts
from kernels.latent_attention import latent_attention_step
from kernels.mla_decode import mla_decode
from kernels.op_set import ExpertSet, OpSet, StepSampling
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.reference import argmax, silu_mul  # torch's own on the GPU; silu_mul: one fused op pair
from kernels.sampling import sample, sampling_mask
from kernels.triton_util import INTERPRET

__all__ = [
    "INTERPRET", "OPS", "TritonOps", "add_rms_norm", "argmax", "pack_blocks", "paged_decode_attention",
    "paged_prefill_attention", "rms_norm", "rotary", "sample", "sampling_mask", "silu_mul", "unpack_blocks",
    "write_kv",
]


class TritonOps(OpSet):
    """The Triton kernels as an op set; the decodes are one group (the kernel reads each row up
    to its context length), read as `VarlenMetadata` with the prefill chunks."""

    name = "triton"
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotary = staticmethod(rotary)
    silu_mul = staticmethod(silu_mul)
    argmax = staticmethod(argmax)
    write_kv = staticmethod(write_kv)
    pack_blocks = staticmethod(pack_blocks)
    unpack_blocks = staticmethod(unpack_blocks)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)

    def prepare_experts(self, experts: ExpertSet) -> None:
        if experts.plain:  # the grouped matmuls read every held expert's weights from one tensor
            experts.stack()

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertSet,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
        if experts.stacked is None:  # biased, clamped experts (gpt-oss): one expert at a time, torch ops
            return super().moe_experts(x, weights, ids, experts, counts)
        return fused_experts(x, *experts.stacked, weights, ids, first_expert=experts.held.start)

    def latent_attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                              latent: int) -> torch.Tensor:
        """Decodes through the MLA decode kernel (kernels/mla_decode.py); prefill chunks by
        the torch path (compute-bound: a Triton MLA prefill kernel is not written)."""
        return latent_attention_step(self.write_kv, q, k, v, k_cache, v_cache, meta, scale, latent, mla_decode)

    def plan_decodes(self, decodes: StepDecodes, device: torch.device | str) -> list[DecodeGroup]:
        return [decodes.group(0, len(decodes), device)] if len(decodes) else []

    def attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
        vm = VarlenMetadata.of(meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_heads, head_dim]
        nd = vm.num_decodes
        if nd:
            self.paged_decode_attention(q[:nd], k_cache, v_cache, vm.decode_block_tables, vm.decode_context_lens,
                                        scale, out=out[:nd])
        if nd < q.shape[0]:
            self.paged_prefill_attention(q[nd:], k_cache, v_cache, vm.prefill_cu_seqlens, vm.prefill_context_lens,
                                         vm.prefill_block_tables, vm.max_prefill_len, scale, out=out[nd:])
        return out

    def sample_step(self, processed: torch.Tensor, rows: StepSampling) -> torch.Tensor:
        p = rows.dense()
        return sample(processed, p.temperature, p.top_k, p.top_p, p.min_p, p.seeds, p.positions)

    def matmul_library(self) -> Any | None:
        return None


OPS = TritonOps()
