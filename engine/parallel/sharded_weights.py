"""Cut a checkpoint's tensors to one tensor-parallel rank's slices (engine/weights.py's `select`)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.sharded_model import ShardedCausalLM
from engine.weights import Select, load_weights


def rank_slicer(cfg: ModelConfig, layout: TensorParallelLayout) -> Select:
    """The `select` of rank `layout.rank`: column-parallel weights (q|k|v, gate|up) by output
    rows, row-parallel ones (o, down) by input columns with their bias on rank 0 only,
    the embedding and the LM head by vocabulary rows; norms, the router and experts whole."""
    d = cfg.head_dim
    q = slice(layout.q_heads.start * d, layout.q_heads.stop * d)
    kv = slice(layout.kv_heads.start * d, layout.kv_heads.stop * d)
    ffn = slice(layout.intermediate.start, layout.intermediate.stop)
    vocab = slice(layout.vocab.start, layout.vocab.stop)
    heads = layout.q_heads
    if cfg.mla is not None:  # latent attention: per-head rows of the query and kv_b_proj, o's per-head inputs
        m = cfg.mla
        mla_rows = {"q_proj": m.qk_head_dim, "q_b_proj": m.qk_head_dim, "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim}
        q = slice(heads.start * m.v_head_dim, heads.stop * m.v_head_dim)  # o_proj's input columns

    def select(target: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        kind = target.rpartition(".")[2]  # "weight" or "bias"
        if ".moe." in target:  # the router, and whole experts (another rank's are never read)
            return tensor
        if ".mla." in target:  # the latent's projection and norms whole: every rank's pool holds it
            per_head = mla_rows.get(target.partition(".mla.")[2].split(".")[0])
            return tensor if per_head is None else tensor[heads.start * per_head:heads.stop * per_head]
        if target.endswith(".sinks"):  # one per query head
            return tensor[layout.q_heads.start:layout.q_heads.stop]
        if ".qkv_proj." in target:
            return tensor[q if shard == 0 else kv]
        if ".gate_up_proj." in target:
            return tensor[ffn]
        if ".o_proj." in target or ".down_proj." in target:
            if kind == "bias":
                return tensor if layout.rank == 0 else torch.zeros_like(tensor)
            return tensor[:, q if ".o_proj." in target else ffn]
        if target in ("embed_tokens.weight", "lm_head.weight") or target.endswith(".shared_head.head.weight"):
            return tensor[vocab]
        return tensor

    return select


def load_sharded_model(folder: str | Path, cfg: ModelConfig, layout: TensorParallelLayout, dtype: torch.dtype,
                       device: str = "cpu", group=None, mtp: bool = False) -> ShardedCausalLM:
    """Rank `layout.rank`'s model with its slices of the checkpoint in `folder`, prepared
    (`mtp`: with its multi-token-prediction layers, engine/mtp.py)."""
    model = ShardedCausalLM(cfg, layout, dtype, device, group, mtp)
    load_weights(model, folder, rank_slicer(cfg, layout))
    model.prepare()
    return model
