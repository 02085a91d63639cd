"""One layer's attention with what the fused kernels do not take: a sliding window (the query
reads only its last `window` positions, itself included) and attention sinks (one learned
logit per head in each softmax's denominator, whose share of the probability goes nowhere:
gpt-oss). Torch ops on any device, over the same metadata the op sets read (decodes gathered
group by group, prefill chunks one by one over their gathered context).

The math is transformers' eager attention term by term (scores, mask, the sink column, the
max subtracted, softmax, the sink dropped), in float32 (float64 stays float64).
"""

from __future__ import annotations

import torch

from kernels.attention_step import AttentionMetadata


def masked_attention_step(
    write_kv,  # the op set's write_kv
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]: written into their slots first
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,  # None: the whole context
    sinks: torch.Tensor | None,  # [num_heads] or None
) -> torch.Tensor:  # like q
    write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    parts = []
    for g in meta.decodes:
        n, width = g.end - g.start, g.block_tables.shape[1] * block_size
        keys = k_cache.index_select(0, g.block_tables.flatten()).view(n, width, kv_heads, head_dim)
        values = v_cache.index_select(0, g.block_tables.flatten()).view(n, width, kv_heads, head_dim)
        last = (g.context_lens - 1)[:, None, None]  # [n, 1, 1]: each query's own position
        valid = visible(torch.arange(width, device=q.device)[None, None, :], last, window)
        parts.append(attend(q[g.start:g.end, None], keys, values, valid, scale, sinks)[:, 0])
    for span in meta.prefills:
        s, e, ctx = span.start, span.start + span.num_new, span.context_len
        table = span.block_table
        keys = k_cache.index_select(0, table).flatten(0, 1)[:ctx]
        values = v_cache.index_select(0, table).flatten(0, 1)[:ctx]
        q_pos = torch.arange(ctx - span.num_new, ctx, device=q.device)[None, :, None]
        valid = visible(torch.arange(ctx, device=q.device)[None, None, :], q_pos, window)
        parts.append(attend(q[None, s:e], keys[None], values[None], valid, scale, sinks)[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal, and inside the window: query_pos - window < key_pos <= query_pos."""
    valid = key_pos <= query_pos
    return valid if window is None else valid & (key_pos > query_pos - window)


def attend(
    q: torch.Tensor,  # [batch, t, num_heads, head_dim]
    k: torch.Tensor,  # [batch, s, kv_heads, head_dim]
    v: torch.Tensor,  # [batch, s, kv_heads, v_dim]: v_dim may differ from head_dim (MLA's latent)
    valid: torch.Tensor,  # [batch, t, s] bool: key visible to query
    scale: float,
    sinks: torch.Tensor | None,  # [num_heads]
) -> torch.Tensor:  # [batch, t, num_heads, v_dim] in q's dtype
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dtype).view(b, t, kv_heads, group, d).permute(0, 2, 3, 1, 4)  # [b, kv, group, t, d]
    kf = k.to(dtype).permute(0, 2, 1, 3)[:, :, None]  # [b, kv, 1, s, d]
    vf = v.to(dtype).permute(0, 2, 1, 3)[:, :, None]
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [b, kv, group, t, s]
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(kv_heads, group)[None, :, :, None, None].expand(b, -1, -1, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = (scores - scores.max(dim=-1, keepdim=True).values).softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = probs @ vf  # [b, kv, group, t, v_dim]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, heads, v.shape[-1]).to(q.dtype)
