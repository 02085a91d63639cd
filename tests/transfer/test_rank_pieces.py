"""The writes that move KV blocks between tensor-parallel workers of any degrees
(transfer/ranks.py), checked by carrying them out byte for byte (memmove over the real
pools' addresses) and comparing each receiving rank's pool with its heads' slice of the
same KV computed whole: equal degrees, a degree into one rank and back, 2 into 4, and
replicated KV heads (fewer heads than ranks) on either side."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from transfer.layout import KVLayout
from transfer.ranks import RankPool, Side, block_descriptors, pack_blocks, write_pieces

LAYERS, BLOCK, DIM, BLOCKS = 2, 4, 8, 6


def _heads(num_kv: int, size: int) -> list[range]:
    if num_kv >= size:
        per = num_kv // size
        return [range(r * per, (r + 1) * per) for r in range(size)]
    replicas = size // num_kv
    return [range(r // replicas, r // replicas + 1) for r in range(size)]


def _worker(full: torch.Tensor | None, num_kv: int, size: int) -> tuple[Side, list[torch.Tensor]]:
    """A worker of `size` ranks: each rank's pool holds its heads of `full` (zeros if None)."""
    heads = _heads(num_kv, size)
    pools = []
    for h in heads:
        pool = torch.zeros(BLOCKS, LAYERS, 2, BLOCK, len(h), DIM, dtype=torch.float32)
        if full is not None:
            pool.copy_(full[..., h.start:h.stop, :])
        pools.append(pool)
    layout = KVLayout.of_pool(pools[0])
    return Side(layout, tuple(RankPool(p.data_ptr(), h.start, len(h)) for p, h in zip(pools, heads))), pools


@pytest.mark.parametrize("num_kv,src_size,dst_size", [
    (4, 1, 1), (4, 2, 2), (4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (1, 2, 4), (2, 4, 2),
])
def test_every_receiving_rank_gets_exactly_its_heads_of_the_blocks_written(num_kv, src_size, dst_size):
    full = torch.randn(BLOCKS, LAYERS, 2, BLOCK, num_kv, DIM)
    ours, src_pools = _worker(full, num_kv, src_size)
    theirs, dst_pools = _worker(None, num_kv, dst_size)
    local, remote = [1, 4, 2], [5, 0, 3]
    pieces = write_pieces(ours, theirs)
    src, dst = block_descriptors(pieces, ours, theirs, local, remote)
    assert (src[:, 1] == dst[:, 1]).all()
    for (s, n, _), (d, _, _) in zip(src.tolist(), dst.tolist()):
        ctypes.memmove(d, s, n)
    heads = _heads(num_kv, dst_size)
    for pool, h in zip(dst_pools, heads):
        want = torch.zeros_like(pool)
        want[remote] = full[local][..., h.start:h.stop, :]
        assert torch.equal(pool, want)
    same = len(_heads(num_kv, src_size)[0]) == len(_heads(num_kv, dst_size)[0])
    assert all(p.whole for p in pieces) == same  # ranks of equal heads move whole blocks, one region each
    if same:
        assert len(src) == len(local) * dst_size


def test_a_head_no_rank_holds_is_refused():
    ours, _ = _worker(None, 4, 2)
    theirs, _ = _worker(None, 4, 1)
    narrowed = Side(ours.layout, (ours.ranks[0],))  # rank 1's heads missing
    with pytest.raises(ValueError, match="KV head 2 of their rank 0 is held by none of our ranks"):
        write_pieces(narrowed, theirs)


@pytest.mark.parametrize("num_kv,src_size,dst_size", [(4, 2, 1), (4, 1, 2), (4, 4, 2), (2, 4, 1), (4, 2, 4)])
def test_packed_blocks_hold_exactly_the_receiving_ranks_heads(num_kv, src_size, dst_size):
    full = torch.randn(BLOCKS, LAYERS, 2, BLOCK, num_kv, DIM)
    ours, src_pools = _worker(full, num_kv, src_size)
    theirs, _ = _worker(None, num_kv, dst_size)
    local = [3, 0, 5]
    pieces = write_pieces(ours, theirs)
    for d, heads in enumerate(_heads(num_kv, dst_size)):
        mine = [p for p in pieces if p.dst_rank == d]
        out = torch.full((len(local), LAYERS, 2, BLOCK, len(heads), DIM), float("nan"))
        pack_blocks(mine, src_pools, local, out)
        assert torch.equal(out, full[local][..., heads.start:heads.stop, :])


def test_descriptors_for_device_pools_carry_each_sides_device():
    """A GPU pool is described by address and device, as NIXL's VRAM segments want: built here
    from made-up device pointers (nothing is written), every row names its side's device."""
    layout = KVLayout(num_blocks=BLOCKS, num_layers=LAYERS, block_size=BLOCK, num_kv_heads=2, head_dim=DIM,
                      dtype="bfloat16")
    ours = Side(layout, (RankPool(0x7F00_0000_0000, 0, 2), RankPool(0x7F10_0000_0000, 2, 2)))
    theirs = Side(replace(layout, num_kv_heads=4), (RankPool(0x7E00_0000_0000, 0, 4),))
    whole = Side(layout, (RankPool(0x7D00_0000_0000, 0, 2), RankPool(0x7D10_0000_0000, 2, 2)))
    src, dst = block_descriptors(write_pieces(ours, whole), ours, whole, [1, 2], [3, 4], device_id=1,
                                 remote_device_id=2)
    assert src.shape == dst.shape == (4, 3) and set(src[:, 2]) == {1} and set(dst[:, 2]) == {2}
    assert list(src[:, 1]) == [layout.block_bytes] * 4
    assert list(dst[:, 0]) == [0x7D00_0000_0000 + b * layout.block_bytes for b in (3, 4)] + \
        [0x7D10_0000_0000 + b * layout.block_bytes for b in (3, 4)]
    rows, _ = block_descriptors(write_pieces(ours, theirs), ours, theirs, [0], [0], device_id=1, remote_device_id=2)
    assert len(rows) == 2 * 2 * LAYERS * BLOCK  # two runs of heads a (layer, K/V, token) row, unstaged
