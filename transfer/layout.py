"""How a worker's KV pool looks to the transfer: blocks, regions and the compatibility hash.

The pool is block-major (engine/kv_cache.py): block b occupies bytes
[b * block_bytes, (b + 1) * block_bytes) of one tensor and holds K and V of every layer.
A block can be described to NIXL as one region (the default), as one region per layer
(K and V of that layer; allows per-layer streaming), or as one region per layer and K/V.
Descriptor `b * regions_per_block + j` is region j of block b on both sides, so a push of
blocks [3, 9] into peer blocks [40, 41] pairs the same regions in the same order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

PROTOCOL_VERSION = 1
LAYOUT_NAME = "block-major/v1"  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


# Bounds on a layout read from a peer's handshake: its descriptor table is built from it
# (a claimed billion blocks would allocate tens of GB), so it must stay near real pools.
MAX_LAYOUT_DIM = 1 << 24
MAX_REGIONS = 1 << 24  # 16M descriptors: 256 GiB of 16 KiB regions


@dataclass(frozen=True)
class KVLayout:
    """The shape of one worker's KV pool, as published in its handshake."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float32", ...
    regions_per_block: int = 1  # descriptor granularity: 1, num_layers or 2 * num_layers
    # what a block holds per (layer, token): "kv_heads", K and V of each KV head; "latent", one
    # latent entry (MLA: the K and V planes are its two halves, a single "head" every rank holds)
    holds: str = "kv_heads"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= MAX_LAYOUT_DIM:
                raise ValueError(f"{name}={value!r}: must be an integer in 1..{MAX_LAYOUT_DIM}")
        if self.num_blocks * self.regions_per_block > MAX_REGIONS:
            raise ValueError(f"{self.num_blocks} blocks x {self.regions_per_block} regions: more than the "
                             f"{MAX_REGIONS} descriptors a peer will prepare for one pool")
        if self.holds not in ("kv_heads", "latent"):
            raise ValueError(f"holds={self.holds!r}: must be 'kv_heads' or 'latent'")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} not supported for transfer; use one of {sorted(DTYPE_BYTES)}")
        if self.regions_per_block not in (1, self.num_layers, 2 * self.num_layers):
            raise ValueError(f"regions_per_block={self.regions_per_block}: must be 1, num_layers "
                             f"({self.num_layers}) or 2 * num_layers")

    @classmethod
    def of_pool(cls, pool, regions_per_block: int = 1, holds: str = "kv_heads") -> KVLayout:
        """The layout of an engine KV pool tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""
        num_blocks, num_layers, two, block_size, kv_heads, head_dim = pool.shape
        if two != 2:
            raise ValueError(f"pool shape {tuple(pool.shape)} is not block-major [blocks, layers, 2, ...]")
        return cls(num_blocks, num_layers, block_size, kv_heads, head_dim, str(pool.dtype).removeprefix("torch."),
                   regions_per_block, holds)

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def region_bytes(self) -> int:
        return self.block_bytes // self.regions_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def compatibility_fields(self, total_kv_heads: int | None = None) -> dict[str, object]:
        """Everything two peers must agree on to exchange blocks (the pool size may differ).
        `total_kv_heads`: the model's, when this pool is one tensor-parallel rank's share of
        them (peers of different degrees agree on the model's count, not on a rank's)."""
        fields = asdict(self)
        del fields["num_blocks"]
        if total_kv_heads is not None:
            fields["num_kv_heads"] = total_kv_heads
        return {"layout": LAYOUT_NAME, **fields}


def compatibility_hash(model: str, layout: KVLayout, total_kv_heads: int | None = None) -> str:
    """Hash of (protocol version, model, dtype, block size, layout): equal means compatible."""
    payload = {"protocol": PROTOCOL_VERSION, "model": model, **layout.compatibility_fields(total_kv_heads)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def region_table(base_addr: int, layout: KVLayout, device_id: int = 0) -> np.ndarray:
    """[num_blocks * regions_per_block, 3] int64 rows (address, length, device) for NIXL."""
    n = layout.num_blocks * layout.regions_per_block
    table = np.empty((n, 3), dtype=np.int64)
    table[:, 0] = base_addr + np.arange(n, dtype=np.int64) * layout.region_bytes
    table[:, 1] = layout.region_bytes
    table[:, 2] = device_id
    return table


def region_indices(block_ids, regions_per_block: int) -> np.ndarray:
    """Descriptor indices (int32) of every region of the given blocks, in order."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    idx = blocks[:, None] * regions_per_block + np.arange(regions_per_block, dtype=np.int64)[None, :]
    return idx.reshape(-1).astype(np.int32)
