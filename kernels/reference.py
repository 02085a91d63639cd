"""Torch reference ops: the CPU op set where no native kernels build (`TorchOps`, below),
and the oracle every kernel is tested against (kernels/triton_ops.py and
kernels/native_ops.py have the same names and signatures).

KV pool layout (see engine/kv_cache.py): per layer a view `k_cache, v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
`block_id * block_size + offset`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.attention_step import AttentionMetadata, DecodeGroup, StepDecodes, group_by_length
from kernels.op_set import OpSet, StepSampling


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,  # [num_tokens] block id of each new token
    slot_offsets: torch.Tensor,  # [num_tokens] offset inside that block
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
) -> None:
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """Each row's greedy token: the first index of its maximum (of its first NaN if any)."""
    return x.argmax(dim=-1)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64, padded with any valid id
    mask: torch.Tensor,  # [num_seqs, 1, 1, max_blocks * block_size] bool: key position is valid
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    width = mask.shape[-1]
    # index_select on the block dimension is several times faster than advanced indexing here.
    flat = block_tables.flatten()
    k = k_cache.index_select(0, flat).view(num_seqs, width, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(num_seqs, width, kv_heads, head_dim).transpose(1, 2)
    # Grouped-query attention: each KV head serves `group` query heads, as `group` query rows.
    q = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,  # [num_new, num_heads, head_dim]: the chunk's queries
    k: torch.Tensor,  # [ctx, kv_heads, head_dim]: the whole context, chunk included, in order
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """Causal attention of a chunk whose queries are the last `num_new` of `ctx` positions."""
    num_new, ctx = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_new == ctx:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(ctx - num_new, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [num_new, ctx]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [n_blocks] int64
    ctx: int,
) -> torch.Tensor:  # [ctx, kv_heads, head_dim]
    return cache.index_select(0, block_table).flatten(0, 1)[:ctx]


# --- Whole-batch forms: the same signatures as the Triton ops (kernels/triton_ops.py), ---
# --- so each kernel is tested against the op here on identical arguments.            ---


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    width = block_tables.shape[1] * k_cache.shape[1]
    valid = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]
    return decode_attention(q, k_cache, v_cache, block_tables, valid[:, None, None, :], scale)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], chunks already written
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = cu[i], cu[i + 1]
        k = gather_context(k_cache, block_tables[i], ctx)
        v = gather_context(v_cache, block_tables[i], ctx)
        out[s:e] = prefill_attention(q[s:e], k, v, scale)
    return out


def pack_blocks(
    pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, num_layers, 2, block_size, kv_heads, head_dim], contiguous
    return pool.index_select(0, block_ids)


def unpack_blocks(
    pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64, distinct
    staging: torch.Tensor,  # [n, num_layers, 2, block_size, kv_heads, head_dim]
) -> None:
    pool.index_copy_(0, block_ids, staging)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """RMS norm in float32 (float64 stays float64), like the Hugging Face reference.

    Not `F.rms_norm` on bf16 input: that loses the model (SmolLM2 answers gibberish), so
    lower precisions are upcast first, normalised, cast back, then scaled by the weight.
    """
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add fused with the next norm."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * ffn] -> [num_tokens, ffn]
    """The gated MLP's activation: silu(gate) * up, gate and up the two halves of each row."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Rotary embedding, rotate-half form, in x's dtype (each op rounds, as in Hugging Face)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def sampling_mask(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    temperature: torch.Tensor,  # [num_seqs] float32 > 0
    top_k: torch.Tensor,  # [num_seqs] int64, 0 (or >= vocab) = off
    top_p: torch.Tensor,  # [num_seqs] float32, 1 = off
    min_p: torch.Tensor,  # [num_seqs] float32, 0 = off
) -> torch.Tensor:  # [num_seqs, vocab] bool: the tokens a row may sample
    """top-k, then top-p on what top-k left, then min-p: engine/sampler.py's order and ties
    (ties with the k-th logit stay; a token stays while the mass strictly before it in
    descending order < top_p, and so does every token tied with the last one kept: each
    stage keeps an upper set of the logits, whatever order a sort puts equal logits in)."""
    scaled = logits / temperature[:, None]
    vocab = scaled.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    keep = scaled >= kth
    masked = scaled.masked_fill(~keep, float("-inf"))
    sorted_logits = masked.sort(dim=-1, descending=True).values
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # non-decreasing: the kept tokens are a prefix
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)  # >= 1: top_p > 0
    cut = sorted_logits.gather(1, num_kept - 1)
    keep &= (scaled >= cut) | (top_p[:, None] >= 1.0)
    max_logit = scaled.max(dim=-1, keepdim=True).values  # truncation never drops the top token
    keep &= ~(scaled < max_logit + min_p.log()[:, None])
    return keep


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32, bias and penalties applied
    temperature: torch.Tensor,  # [num_seqs] float32 > 0
    top_k: torch.Tensor,  # [num_seqs] int64
    top_p: torch.Tensor,  # [num_seqs] float32
    min_p: torch.Tensor,  # [num_seqs] float32
    exponentials: torch.Tensor,  # [num_seqs, vocab] float32 Exp(1) draws, all > 0
) -> torch.Tensor:  # [num_seqs] int64
    """The exponential race argmax(p / E) over the truncated softmax(logits / temperature).
    The Triton op derives E from (seed, position) itself (engine.seeded_random's hash)."""
    keep = sampling_mask(logits, temperature, top_k, top_p, min_p)
    probs = (logits / temperature[:, None]).masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return (probs / exponentials).argmax(dim=-1)


class TorchOps(OpSet):
    """The op set of the functions above. A step's decodes go in groups of similar context
    length (`group_by_length`: a gathering op pays for every padded position), each gathered
    and masked (`decode_attention`); prefill chunks one by one over their gathered context
    (`prefill_attention`); sampling by the engine's torch stages."""

    name = "torch"
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
    # The per-group and per-chunk forms `attention_step` takes.
    decode_attention = staticmethod(decode_attention)
    prefill_attention = staticmethod(prefill_attention)
    gather_context = staticmethod(gather_context)

    def plan_decodes(self, decodes: StepDecodes, device: torch.device | str) -> list[DecodeGroup]:
        return [decodes.masked_group(i, j, device) for i, j in group_by_length(decodes.lengths)]

    def attention_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
        parts = [self.decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.mask, scale)
                 for g in meta.decodes]
        for span in meta.prefills:
            s, e = span.start, span.start + span.num_new
            if span.context_len == span.num_new:  # no cached prefix: the chunk is its own context
                kc, vc = k[s:e], v[s:e]
            else:
                kc = self.gather_context(k_cache, span.block_table, span.context_len)
                vc = self.gather_context(v_cache, span.block_table, span.context_len)
            parts.append(self.prefill_attention(q[s:e], kc, vc, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def sample_step(self, processed: torch.Tensor, rows: StepSampling) -> torch.Tensor:
        return rows.per_row(processed)

    def matmul_library(self) -> Any | None:
        return None


OPS = TorchOps()
