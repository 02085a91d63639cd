"""transfer/: what two agents must agree on, checked without NIXL: the KV layout and its
region tables (how a block is cut into NIXL descriptors), the compatibility hash, agent
names, the handshake's TransferInfo (round trip, and every malformed or incompatible
blob refused, naming why) and the notifications that end a push.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness.transfer_peers import BLOCK_BYTES, MODEL
from transfer.handshake import HandshakeError, TransferInfo, agent_name, check_compatible, parse_agent_name
from transfer.layout import KVLayout, compatibility_hash, region_indices, region_table
from transfer.messages import Notification, NotifKind, decode, encode
from transfer.ranks import RankPool

LAYOUT = KVLayout(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def named_fields(message: str) -> set[str]:
    """The field names listed in a check_compatible message: '... (f1: a here vs b, f2: ...); ...'."""
    diffs = re.search(r"\((.*)\); both sides", message).group(1)
    return {part.split(":")[0] for part in diffs.split(", ")}


def test_layout_sizes_for_each_granularity():
    assert LAYOUT.block_bytes == BLOCK_BYTES == 2 * 4 * 16 * 2 * 64 * 2
    assert LAYOUT.pool_bytes == 64 * BLOCK_BYTES
    for regions, region_bytes in [(1, BLOCK_BYTES), (4, BLOCK_BYTES // 4), (8, BLOCK_BYTES // 8)]:
        assert replace(LAYOUT, regions_per_block=regions).region_bytes == region_bytes
    assert replace(LAYOUT, dtype="float32").block_bytes == 2 * BLOCK_BYTES


@pytest.mark.parametrize("regions", [1, 4, 8])
def test_region_table_tiles_the_pool(regions):
    layout = replace(LAYOUT, num_blocks=5, regions_per_block=regions)
    base = 0x7F0000001000
    table = region_table(base, layout, device_id=3)  # [num_blocks * regions, 3]
    assert table.shape == (5 * regions, 3) and table.dtype == np.int64
    assert (table[:, 1] == BLOCK_BYTES // regions).all() and (table[:, 2] == 3).all()
    # Consecutive, gap-free, starting at the base: region j of block b is row b * regions + j.
    assert (table[:, 0] == base + np.arange(5 * regions) * (BLOCK_BYTES // regions)).all()
    assert table[2 * regions, 0] == base + 2 * BLOCK_BYTES
    assert table[-1, 0] + table[-1, 1] == base + layout.pool_bytes


def test_region_indices_pair_regions_of_blocks_in_order():
    assert region_indices([3, 9], 1).tolist() == [3, 9]
    assert region_indices([3, 9], 4).tolist() == [12, 13, 14, 15, 36, 37, 38, 39]
    assert region_indices([1], 8).tolist() == list(range(8, 16))
    assert region_indices([], 4).tolist() == []
    assert region_indices([63], 8).dtype == np.int32


def test_layout_refusals():
    with pytest.raises(ValueError, match="regions_per_block=3"):
        replace(LAYOUT, regions_per_block=3)
    with pytest.raises(ValueError, match="int8"):
        replace(LAYOUT, dtype="int8")


def test_compatibility_hash_ignores_pool_size_only():
    h = compatibility_hash(MODEL, LAYOUT)
    assert compatibility_hash(MODEL, replace(LAYOUT, num_blocks=1000)) == h
    for other in [replace(LAYOUT, block_size=32), replace(LAYOUT, dtype="float16"),
                  replace(LAYOUT, regions_per_block=4), replace(LAYOUT, num_kv_heads=3)]:
        assert compatibility_hash(MODEL, other) != h
    assert compatibility_hash("other", LAYOUT) != h


@settings(max_examples=200, deadline=None)
@given(role=st.text(st.characters(blacklist_characters="-", blacklist_categories=("Cs",)), min_size=1),
       worker_id=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1),
       incarnation=st.integers(0, 2**40))
def test_agent_name_round_trips(role, worker_id, incarnation):
    assert parse_agent_name(agent_name(role, worker_id, incarnation)) == (role, worker_id, incarnation)


def test_agent_name_refusals():
    for bad in ["decode", "decode-1", "-0-1", "decode-0-x", "decode--1", "decode-0-"]:
        with pytest.raises(HandshakeError):
            parse_agent_name(bad)
    for args in [("de-code", "0", 1), ("", "0", 1), ("decode", "", 1), ("decode", "0", -1)]:
        with pytest.raises(ValueError):
            agent_name(*args)


def _info(**changes) -> TransferInfo:
    info = TransferInfo("decode-0-1", bytes(range(256)) * 3, MODEL, LAYOUT, 0x7F00DEAD0000, 0)
    return replace(info, **changes)


def test_transfer_info_round_trip():
    info = _info()
    assert TransferInfo.from_bytes(info.to_bytes()) == info
    assert info.worker_key == ("decode", "0")
    gpu = _info(mem_type="VRAM", device_id=3)
    assert TransferInfo.from_bytes(gpu.to_bytes()) == gpu and gpu.compat_hash == info.compat_hash  # kinds may pair
    older = json.loads(info.to_bytes())
    del older["mem_type"]  # a peer from before the field: its pool is host memory
    assert TransferInfo.from_bytes(json.dumps(older).encode()).mem_type == "DRAM"


def _edited(edit) -> bytes:
    d = json.loads(_info().to_bytes())
    edit(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize("blob, words", [
    (_edited(lambda d: d.update(compat_hash="0" * 32)), "compatibility hash"),
    (_edited(lambda d: d["layout"].update(block_size=32)), "compatibility hash"),  # field edited, hash kept
    (_edited(lambda d: d.update(model="other")), "compatibility hash"),
    (_edited(lambda d: d.update(protocol_version=2)), "protocol 2"),
    (_edited(lambda d: d.pop("base_addr")), "malformed"),
    (_edited(lambda d: d["layout"].update(regions_per_block=3)), "malformed"),
    (_edited(lambda d: d["layout"].update(page_size=16)), "malformed"),
    (_edited(lambda d: d.update(agent_metadata="not base64!")), "malformed"),
    (_edited(lambda d: d.update(agent_name="nodashes")), "nodashes"),
    (_edited(lambda d: d.update(agent_name=5)), "malformed"),
    (_edited(lambda d: d.update(mem_type="HBM")), "memory kind 'HBM': one of DRAM, VRAM"),
    # num_blocks is outside the compatibility hash (pools differ in size), so only a bound stops
    # a claimed billion blocks from becoming a descriptor table of tens of GB
    (_edited(lambda d: d["layout"].update(num_blocks=10**9)), "num_blocks=1000000000: must be an integer in"),
    (_edited(lambda d: d["layout"].update(num_blocks=0)), "num_blocks=0"),
    (b"not json at all", "malformed"),
    (b"\xff\xfe\x00", "malformed"),
    (b"[1, 2, 3]", "malformed"),
    (b'{"kind": "vllm-nixl-metadata"}', "malformed"),
])
def test_transfer_info_from_bytes_refuses(blob, words):
    with pytest.raises(HandshakeError, match=re.escape(words)):
        TransferInfo.from_bytes(blob)


def test_check_compatible_names_every_differing_field():
    check_compatible(_info(agent_name="prefill-0-1"), _info(layout=replace(LAYOUT, num_blocks=7)))
    with pytest.raises(HandshakeError) as refused:
        check_compatible(_info(agent_name="prefill-0-1"),
                         _info(model="m2", layout=replace(LAYOUT, dtype="float32", head_dim=128)))
    assert named_fields(str(refused.value)) == {"model", "dtype", "head_dim"}


def _parallel(*heads: tuple[int, int], layout: KVLayout = LAYOUT) -> TransferInfo:
    """A tensor-parallel worker's info: one (head_start, head_count) per rank."""
    ranks = tuple(RankPool(0x7F0000000000 + i * 0x100000000, start, count) for i, (start, count) in enumerate(heads))
    return _info(layout=layout, ranks=ranks, base_addr=ranks[0].base_addr)


def test_tensor_parallel_infos_round_trip_and_are_compatible_across_degrees():
    one = _info(layout=replace(LAYOUT, num_kv_heads=4))  # every head in one pool
    two = _parallel((0, 2), (2, 2))  # LAYOUT: two heads a rank
    four = _parallel((0, 1), (1, 1), (2, 1), (3, 1), layout=replace(LAYOUT, num_kv_heads=1))
    for info in (two, four):
        assert TransferInfo.from_bytes(info.to_bytes()) == info and info.total_kv_heads == 4
    assert one.compat_hash == two.compat_hash == four.compat_hash  # the model's heads, not a rank's
    check_compatible(two, four)
    assert one.compat_hash == compatibility_hash(MODEL, replace(LAYOUT, num_kv_heads=4))  # one rank: as before
    with pytest.raises(HandshakeError) as refused:  # a model of another head count is still refused
        check_compatible(two, _info(layout=replace(LAYOUT, num_kv_heads=2)))
    assert named_fields(str(refused.value)) == {"num_kv_heads"}


@pytest.mark.parametrize("ranks, words", [
    ([[1, 0, 2], [2, 4, 2]], "hold KV heads [0, 1, 4, 5], not every head from 0"),  # heads 2, 3 held by none
    ([[1, 0, 2], [2, 3, 2]], "hold KV heads [0, 1, 3, 4], not every head from 0"),
    ([[1, 0, 2], [2, 2, 1]], "rank 1 holds KV heads 2..+1, its layout says 2 per rank"),
    ([[1, -2, 2], [2, 0, 2]], "rank 0 holds KV heads -2..+2"),
    ([[1, 0, 2]] * 1025, "1025 ranks, more than 1024"),
    ([[1, 0]], "malformed"),
])
def test_a_tensor_parallel_info_whose_ranks_leave_heads_out_is_refused(ranks, words):
    d = json.loads(_parallel((0, 2), (2, 2)).to_bytes())
    d["ranks"] = ranks
    d["compat_hash"] = _parallel((0, 2), (2, 2)).compat_hash if words != "malformed" else d["compat_hash"]
    with pytest.raises(HandshakeError, match=re.escape(words)):
        TransferInfo.from_bytes(json.dumps(d).encode())


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(NotifKind),
       request_id=st.text(st.characters(blacklist_characters=" ", blacklist_categories=("Cs",)), min_size=1),
       num_blocks=st.integers(0, 10**6))
def test_notification_round_trips(kind, request_id, num_blocks):
    assert decode("prefill-0-1", encode(kind, request_id, num_blocks)) == \
        Notification("prefill-0-1", kind, request_id, num_blocks)


def test_foreign_notifications_decode_to_none():
    for message in [b"", b"hello", b"pdkv/2 done r 1", b"pdkv/1 close r 1", b"pdkv/1 done r x",
                    b"pdkv/1 done r 1 extra", b"\xff\xfe", "pdkv/1 done".encode() + b"\x00"]:
        assert decode("x", message) is None
    for bad in ["", "has space"]:
        with pytest.raises(ValueError):
            encode(NotifKind.DONE, bad, 1)
