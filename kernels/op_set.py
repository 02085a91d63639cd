"""The op set contract: what the model, the runner and the sampler call on a kernel backend.

One implementation per backend, one file each: `TorchOps` (kernels/reference.py: torch ops,
the oracle of every kernel), `NativeOps` (kernels/native_ops.py: the torch ops with native
CPU kernels where they win) and `TritonOps` (kernels/triton_ops.py). `kernels.get_ops(device)`
picks one. How a backend takes a step's attention and sampling (padded groups, in place,
one batched call) is its own business behind `plan_decodes`, `attention_step` and
`sample_step`: callers never ask a backend what it can do.

KV pool layout (engine/kv_cache.py): per layer a view `k_cache, v_cache` of shape
[num_blocks, block_size, kv_heads, head_dim]; a token's slot is `block_id * block_size +
offset`. Ops compute in float32 whatever the input dtype (float32, bfloat16; float64 in
tests) and return the input's dtype unless said otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kernels.attention_step import AttentionMetadata, DecodeGroup, StepDecodes
from kernels.latent_attention import latent_attention_step
from kernels.masked_attention import masked_attention_step


@dataclass(frozen=True)
class DenseSampling:
    """Every sampled row's parameters, neutral where a row does not use one."""

    temperature: torch.Tensor  # [num_seqs] float32 > 0
    top_k: torch.Tensor  # [num_seqs] int64, 0 = off
    top_p: torch.Tensor  # [num_seqs] float32, 1 = off
    min_p: torch.Tensor  # [num_seqs] float32, 0 = off
    seeds: torch.Tensor  # [num_seqs] int64 in [0, 2**63): the request's seed, else a fresh draw
    positions: torch.Tensor  # [num_seqs] int64: tokens the request has output so far (0 unseeded)


class StepSampling(Protocol):
    """One step's sampled rows as the engine holds them (engine/sampler.py), in the two
    forms an op set may take them in."""

    def per_row(self, processed: torch.Tensor) -> torch.Tensor:
        """[num_seqs] int64 tokens drawn by the engine's torch stages: truncation on the
        sub-batches of rows that ask for it, inverse CDF on unseeded rows, the seeded
        exponential race on seeded ones. `processed`: [num_seqs, vocab] float32."""
        ...

    def dense(self) -> DenseSampling:
        """Every row's parameters as [num_seqs] tensors, for one whole-batch kernel."""
        ...


class ExpertSet(Protocol):
    """One mixture-of-experts layer's experts as an op set takes them (engine/moe.py): the ones
    this rank holds, by global index, each a SwiGLU MLP."""

    num_experts: int  # in the whole layer (ids index these)
    held: range  # the experts this rank holds
    stacked: tuple[torch.Tensor, torch.Tensor] | None  # ([held, 2 * ffn, hidden], [held, hidden, ffn]) once stacked
    plain: bool  # SiLU(gate) * up with no biases: the form a fused kernel computes (not gpt-oss's)

    def run(self, expert: int, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """Expert `expert`'s MLP over rows x [rows, hidden] -> [rows, hidden]."""
        ...

    def stack(self) -> None:
        """Lay the held experts' weights out as `stacked` (each expert's linears then views of it)."""
        ...


class OpSet(ABC):
    """A kernel backend. Methods take tensors on the backend's device; shapes in comments."""

    name: ClassVar[str]  # "torch", "native" or "triton": logs and benchmarks say which ran

    # --- Row-wise ops (every token of the step) ---

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [num_tokens, hidden], weight [hidden] -> [num_tokens, hidden]: RMS norm in float32
        (float64 stays float64), cast back, then scaled by the weight (Hugging Face's order)."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [num_tokens, hidden] -> (rms_norm(residual + x), residual + x): the
        residual add fused with the next norm, the same numbers as adding first."""

    @abstractmethod
    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim], cos / sin [num_tokens, 1, head_dim] -> like x:
        rotary embedding, rotate-half form, in x's dtype."""

    @abstractmethod
    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, 2 * ffn] -> [num_tokens, ffn]: silu(gate) * up, the row's halves."""

    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, vocab] -> [rows] int64: each row's first maximum (its first NaN if any)."""

    # --- The paged KV pool ---

    @abstractmethod
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_blocks: torch.Tensor,
                 slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [num_tokens, kv_heads, head_dim] into their slots: slot_blocks, slot_offsets
        [num_tokens] int64 (block id, offset inside it)."""

    @abstractmethod
    def pack_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """pool [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], block_ids [n]
        int64 -> [n, num_layers, 2, block_size, kv_heads, head_dim] contiguous (to send)."""

    @abstractmethod
    def unpack_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
        """staging [n, num_layers, 2, block_size, kv_heads, head_dim] into pool's blocks
        block_ids [n] int64, distinct (what `pack_blocks` sent)."""

    # --- Attention over the pool, whole batches ---

    @abstractmethod
    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        """One query token per sequence: q [num_seqs, num_heads, head_dim], block_tables
        [num_seqs, max_blocks] int64 (read up to each context length), context_lens [num_seqs]
        int64 (the query's own position included) -> [num_seqs, num_heads, head_dim]."""

    @abstractmethod
    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                block_tables: torch.Tensor, max_seqlen_q: int, scale: float) -> torch.Tensor:
        """Causal attention of prefill chunks, back to back: q [num_tokens, num_heads, head_dim],
        cu_seqlens_q [num_seqs + 1] int64, context_lens [num_seqs] (cached prefix + chunk, whose
        K/V is already in the pool), block_tables [num_seqs, max_blocks] -> like q."""

    # --- One engine step ---

    @abstractmethod
    def plan_decodes(self, decodes: StepDecodes, device: torch.device | str) -> list[DecodeGroup]:
        """Once per step: the step's decodes (ascending context length) as the groups
        `attention_step` takes, covering [0, len(decodes)) in order; none for no decodes."""

    @abstractmethod
    def attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One layer's attention over the step's flat batch: q [num_tokens, num_heads, head_dim],
        k, v [num_tokens, kv_heads, head_dim] (written into their slots first), decodes then
        prefill chunks as `meta` lays them out (its decodes from `plan_decodes`) -> like q."""

    def masked_attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                              sinks: torch.Tensor | None) -> torch.Tensor:
        """`attention_step` with a sliding window (each query reads its last `window` positions)
        and / or attention sinks ([num_heads] logits in each softmax's denominator). Default:
        torch ops over the gathered context (kernels/masked_attention.py)."""
        return masked_attention_step(self.write_kv, q, k, v, k_cache, v_cache, meta, scale, window, sinks)

    def latent_attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                              latent: int) -> torch.Tensor:
        """Multi-head latent attention over a latent pool, absorbed: q [num_tokens, num_heads,
        entry] ([query in latent space | rotary query]), k, v [num_tokens, 1, entry / 2] (each new
        token's entry, halved into the K and V planes, written first) -> [num_tokens, num_heads,
        latent]: each head's softmax-weighted sum of the entries' first `latent` values. Default:
        torch ops over the gathered entries (kernels/latent_attention.py)."""
        return latent_attention_step(self.write_kv, q, k, v, k_cache, v_cache, meta, scale, latent)

    @abstractmethod
    def sample_step(self, processed: torch.Tensor, rows: StepSampling) -> torch.Tensor:
        """processed [num_seqs, vocab] float32 (bias, penalties and grammar applied) -> [num_seqs]
        int64 tokens drawn by each row's temperature, truncation and seed (greedy rows: any)."""

    # --- Mixture of experts ---

    def prepare_experts(self, experts: ExpertSet) -> None:
        """After the weights are loaded: lay an expert layer out as `moe_experts` reads it here
        (default: as loaded, one set of linears per expert)."""

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertSet,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, hidden], weights and ids [tokens, k] (each token's experts, by global index,
        and their routing weights in x's dtype) -> [tokens, hidden]: the weighted sum of each
        token's experts that `experts` holds (another rank's count zero here). `counts`: the
        slots routed to each expert [num_experts] if the caller has them (computed otherwise).
        Default: the token slots grouped by expert (one stable sort), each held expert's MLP
        run once over its rows, weighted and added back."""
        k = ids.shape[1]
        flat = ids.flatten()  # slot j of token t at t * k + j
        order = flat.argsort(stable=True)
        if counts is None:
            counts = torch.bincount(flat, minlength=experts.num_experts)
        ends = counts.cumsum(0).tolist()
        out = torch.zeros_like(x)
        flat_weights = weights.flatten()
        for e in experts.held:
            start, end = (ends[e - 1] if e else 0), ends[e]
            if start == end:
                continue
            slots = order[start:end]
            tokens = slots // k
            out.index_add_(0, tokens, experts.run(e, x[tokens], self) * flat_weights[slots, None])
        return out

    # --- Matmul ---

    @abstractmethod
    def matmul_library(self) -> Any | None:
        """The native library kernels.linear packs weights for, or None (torch's matmuls)."""
