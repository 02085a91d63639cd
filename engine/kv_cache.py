"""The paged KV pool of one worker: one tensor, block-major.

Layout: `[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`.
Block-major keeps every block's K and V for all layers in one contiguous region
(num_layers * 2 * block_size * kv_heads * head_dim * itemsize bytes: 360 KiB for
SmolLM2 in bf16), which is what a KV transfer wants: NIXL moves regions of >= 16 KiB near
memcpy speed, while a layer-major layout would cut each block into 6 KiB pieces.
Attention reads per-layer strided views `[num_blocks, block_size, kv_heads, head_dim]`,
block after block from all over the pool: the pool sits on 2 MiB pages where the host
allows (kernels/memory.py), so those reads do not miss the TLB at nearly every block.
"""

from __future__ import annotations

import torch

import kernels.memory
from engine.config import ModelConfig


def pool_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]"""
    return num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", pool: torch.Tensor | None = None):
        """`pool`: memory of that shape made elsewhere (a tensor-parallel rank's, shared
        with rank 0: kernels.memory.shared_zeros); default: a new pool."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = pool_shape(cfg, num_blocks, block_size)
        if pool is not None and (tuple(pool.shape) != shape or pool.dtype != dtype):
            raise ValueError(f"a KV pool of {tuple(pool.shape)} {pool.dtype} given for {shape} {dtype}")
        # on huge pages where the host allows: a step reads blocks from all over the pool
        self.pool = pool if pool is not None else kernels.memory.zeros(shape, dtype, device)
        # Per layer: (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim].
        self.layers = [(self.pool[:, i, 0], self.pool[:, i, 1]) for i in range(cfg.num_layers)]

    @property
    def block_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()

    @property
    def total_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
