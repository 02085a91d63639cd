"""A tensor-parallel worker's KV, as the transfer sees it: one pool per rank, each holding a
run of the model's KV heads, and the writes that move a block between two workers of any
degrees.

A worker of degree N has N pools of the same block-major shape (engine/kv_cache.py), with
the same block ids, rank r's holding KV heads [start, start + count): sharded (count =
heads / N) or, with fewer KV heads than ranks, one head replicated on N / heads ranks. Its
transfer agent (rank 0's) registers all N (on CPU the followers' pools are memory shared
with rank 0: engine/parallel/rank_group.py), so one NIXL write with one notification moves
a block between any two workers, whatever their degrees, without the other ranks taking part.
A latent model's ranks all hold the same KV (one replicated "head"): on CPU its group keeps
a single pool every rank maps, published as one rank's, so a block crosses once per group;
with a pool per rank, once per receiving rank, from our first.

    pieces = write_pieces(ours, theirs)            # which of our heads go to which of their ranks
    local, remote = block_descriptors(pieces, ours, theirs, local_blocks, remote_blocks)

Every head of every receiving rank (replicas included) is written, from the first of our
ranks that holds it. Where a receiving rank's heads are exactly one of our ranks' (equal
degrees), a block is one region. Otherwise the sender packs that rank's heads of each
block into its block layout in registered scratch memory (`pack_blocks`,
transfer/staging.py) and writes whole packed blocks: a copy at memory speed on the sender
instead of one NIXL region per (layer, K/V, token) row and run of heads, which
`block_descriptors` still describes for a write too large to stage (measured 35-100x
slower than whole blocks: bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from transfer.layout import DTYPE_BYTES, KVLayout


@dataclass(frozen=True)
class RankPool:
    """One rank's pool, as a peer publishes it."""

    base_addr: int  # its first byte, in the address space of the worker's agent (rank 0's)
    head_start: int  # the first of the model's KV heads it holds
    head_count: int  # as many as the layout's num_kv_heads

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_start + self.head_count)


@dataclass(frozen=True)
class Side:
    """One worker's KV for a write: its pools' common layout and each rank's pool."""

    layout: KVLayout
    ranks: tuple[RankPool, ...]

    @property
    def row_bytes(self) -> int:
        """One (layer, K/V, token) row: every KV head of the rank."""
        return self.layout.num_kv_heads * self.layout.head_dim * DTYPE_BYTES[self.layout.dtype]


@dataclass(frozen=True)
class Piece:
    """A run of heads written from one of our ranks into one of theirs."""

    src_rank: int
    dst_rank: int
    src_head: int  # the run's first head, as an index into our rank's heads
    dst_head: int  # and into theirs
    count: int
    whole: bool  # the run is both ranks' every head: whole blocks


def write_pieces(ours: Side, theirs: Side) -> list[Piece]:
    """Where each head of each of their ranks comes from (the first of our ranks holding it),
    in runs. ValueError if one of their heads is held by none of our ranks."""
    pieces: list[Piece] = []
    for d, dst in enumerate(theirs.ranks):
        run: Piece | None = None
        for i, head in enumerate(dst.heads):
            src = next((s for s, pool in enumerate(ours.ranks) if head in pool.heads), None)
            if src is None:
                raise ValueError(f"KV head {head} of their rank {d} is held by none of our ranks")
            j = head - ours.ranks[src].head_start
            if run is not None and run.src_rank == src and run.src_head + run.count == j:
                run = Piece(src, d, run.src_head, run.dst_head, run.count + 1, False)
                pieces[-1] = run
            else:
                run = Piece(src, d, j, i, 1, False)
                pieces.append(run)
    return [Piece(p.src_rank, p.dst_rank, p.src_head, p.dst_head, p.count,
                  p.count == ours.layout.num_kv_heads == theirs.layout.num_kv_heads) for p in pieces]


def block_descriptors(pieces: list[Piece], ours: Side, theirs: Side, local_blocks, remote_blocks,
                      device_id: int = 0, remote_device_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """([n, 3], [n, 3]) int64 rows (address, length, device) of our regions and theirs, in
    pairs, for writing our blocks `local_blocks[i]` into their `remote_blocks[i]`."""
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    item = DTYPE_BYTES[ours.layout.dtype]
    head_bytes = ours.layout.head_dim * item
    rows = 2 * ours.layout.num_layers * ours.layout.block_size
    local, remote = [], []
    for p in pieces:
        src, dst = ours.ranks[p.src_rank], theirs.ranks[p.dst_rank]
        src_at = src.base_addr + lb * ours.layout.block_bytes  # [blocks]
        dst_at = dst.base_addr + rb * theirs.layout.block_bytes
        if p.whole:
            length = np.full(len(lb), ours.layout.block_bytes, dtype=np.int64)
            local.append(_rows(src_at, length, device_id))
            remote.append(_rows(dst_at, length, remote_device_id))
            continue
        r = np.arange(rows, dtype=np.int64)
        src_at = (src_at[:, None] + r[None, :] * ours.row_bytes + p.src_head * head_bytes).reshape(-1)
        dst_at = (dst_at[:, None] + r[None, :] * theirs.row_bytes + p.dst_head * head_bytes).reshape(-1)
        length = np.full(len(src_at), p.count * head_bytes, dtype=np.int64)
        local.append(_rows(src_at, length, device_id))
        remote.append(_rows(dst_at, length, remote_device_id))
    return np.concatenate(local), np.concatenate(remote)


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    return np.stack([addresses, lengths, np.full(len(addresses), device_id, dtype=np.int64)], axis=1)


def pack_blocks(pieces: list[Piece], src_pools: list[torch.Tensor], local_blocks, out: torch.Tensor) -> None:
    """Write into `out` ([blocks, layers, 2, block_size, their rank's heads, head_dim]) one
    receiving rank's heads of our blocks `local_blocks`, from `pieces` (that rank's, none whole)."""
    one_run = len(pieces) == 1 and pieces[0].count == out.shape[-2]
    if one_run:  # every head of theirs from one of our ranks: gathered straight into `out`, one pass
        p = pieces[0]
        heads = src_pools[p.src_rank][..., p.src_head:p.src_head + p.count, :]
        torch.index_select(heads, 0, torch.as_tensor(local_blocks, dtype=torch.int64, device=out.device), out=out)
        return
    for i, block in enumerate(local_blocks):  # strided copies block by block: one pass, no temporary
        for p in pieces:
            out[i, ..., p.dst_head:p.dst_head + p.count, :].copy_(
                src_pools[p.src_rank][block, ..., p.src_head:p.src_head + p.count, :])
