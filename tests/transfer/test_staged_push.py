"""A push into a tensor-parallel worker of another degree packs blocks in the sender's
staging area (transfer/staging.py): its bytes come back on every way a write ends (done,
failed, timed out, aborted), a chunk waits while the area is full and posts once an
earlier write gives room back, and a chunk larger than the whole area goes out as per-row
regions instead of waiting for room that never comes. NIXL is the fake of fake_nixl.py:
what is checked is the pusher's bookkeeping, not the bytes (test_rank_pieces.py and the
real workers of tests/worker/test_tensor_parallel_transfer.py check those)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from bench.harness.transfer_peers import MODEL
from tests.transfer.fake_nixl import LAYOUT, fake_agent
from transfer.agent import Peer
from transfer.handshake import TransferInfo
from transfer.push import KVPusher, PushStatus
from transfer.ranks import RankPool
from transfer.staging import Staging

THEIRS = replace(LAYOUT, num_kv_heads=LAYOUT.num_kv_heads // 2)  # a receiver of two ranks, half the heads each


def _pusher(capacity_blocks: int) -> tuple[KVPusher, Staging]:
    agent = fake_agent()
    shape = (LAYOUT.num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    agent.pool = torch.zeros(shape, dtype=getattr(torch, LAYOUT.dtype))
    agent.rank_tensors, agent.mem_type, agent.device_id = [agent.pool], "DRAM", 0
    agent._staging = Staging(agent.nixl, capacity_blocks * THEIRS.block_bytes)
    half = THEIRS.num_kv_heads
    info = TransferInfo("decode-0-1", b"", MODEL, THEIRS, 1 << 30,
                        ranks=(RankPool(1 << 30, 0, half), RankPool(1 << 31, half, half)))
    agent.peers = {"decode-0-1": Peer("decode-0-1", info, None)}
    return KVPusher(agent), agent._staging


def test_staged_bytes_come_back_however_a_write_ends():
    pusher, staging = _pusher(64)
    nixl = pusher.agent.nixl
    pusher.start("done", "decode-0-1")
    pusher.push("done", [1, 2], [3, 4], last=True)
    assert staging.bytes_taken == 2 * 2 * THEIRS.block_bytes  # two blocks packed for each receiving rank
    assert len(nixl.made[-1].local) == 4  # whole packed blocks: one region each
    nixl.made[-1].state = "DONE"
    assert [e.status for e in pusher.poll()] == [PushStatus.DONE] and staging.bytes_taken == 0

    pusher.start("error", "decode-0-1")
    pusher.push("error", [1, 2], [3, 4])
    nixl.made[-1].state = "ERR"
    assert [e.status for e in pusher.poll()] == [PushStatus.FAILED] and staging.bytes_taken == 0

    pusher.start("late", "decode-0-1", timeout_s=0.0)
    pusher.push("late", [5], [6])
    time.sleep(0.01)
    assert [e.reason for e in pusher.poll()] == ["timeout"] and staging.bytes_taken == 0

    pusher.start("aborted", "decode-0-1")
    pusher.push("aborted", [7], [8])
    pusher.abort("aborted")
    nixl.made[-1].state = "DONE"
    assert [e.status for e in pusher.poll()] == [PushStatus.ABORTED] and staging.bytes_taken == 0


def test_a_chunk_waits_for_room_and_posts_once_an_earlier_write_ends():
    pusher, staging = _pusher(4)  # two blocks for each of two receiving ranks
    nixl = pusher.agent.nixl
    pusher.start("a", "decode-0-1")
    pusher.start("b", "decode-0-1")
    pusher.push("a", [1, 2], [3, 4], last=True)
    pusher.push("b", [5], [6], last=True)
    assert len(nixl.made) == 1 and pusher.poll() == []  # b waits: the area is full
    nixl.made[0].state = "DONE"
    assert [e.request_id for e in pusher.poll()] == ["a"] and len(nixl.made) == 2  # then b goes
    nixl.made[1].state = "DONE"
    assert [e.request_id for e in pusher.poll()] == ["b"] and staging.bytes_taken == 0


def test_a_chunk_larger_than_the_whole_area_goes_out_as_rows_at_once():
    pusher, staging = _pusher(4)
    pusher.start("big", "decode-0-1")
    pusher.push("big", [1, 2, 3], [4, 5, 6], last=True)  # 3 blocks x 2 ranks: more than 4 fit
    made = pusher.agent.nixl.made
    assert len(made) == 1 and staging.bytes_taken == 0
    assert len(made[0].local) == 3 * 2 * 2 * LAYOUT.num_layers * LAYOUT.block_size  # a region per row and rank


@pytest.mark.parametrize("blocks", [[0], [3, 1, 2]])
def test_packed_blocks_hold_the_receiving_ranks_heads(blocks):
    pusher, staging = _pusher(8)
    pool = pusher.agent.pool
    pool.copy_(torch.randn(pool.shape))
    pusher.start("r", "decode-0-1")
    pusher.push("r", blocks, list(range(len(blocks))), last=True)
    half, n = THEIRS.num_kv_heads, len(blocks)
    shape = (n, LAYOUT.num_layers, 2, LAYOUT.block_size, half, LAYOUT.head_dim)
    rows = pusher.agent.nixl.made[0].local
    for rank in range(2):
        at = rows[rank * n][0] - staging.base_addr
        assert torch.equal(staging.view(at, shape, pool.dtype), pool[blocks][..., rank * half:(rank + 1) * half, :])
