"""The KV transfer benchmark (bench/transfer.py) between tensor-parallel degrees: its pairs
parsed and refused, and one pair (2 ranks into 1) pushed for real between the bench's two
processes, its rows shaped as reported (the regions posted counted from the writes, the
receiving rank's heads staged) and every receiving rank checked against its heads, with a
wrong expectation and a wrong count of regions caught (no timing is asserted)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from bench import transfer
from bench.harness.bandwidth_peers import rank_heads, receiver_main, sender_main


def test_pairs_put_the_baseline_first_and_refuse_degrees_the_heads_cannot_take(capsys):
    args = transfer.parse_args(["--quick", "--tp-pairs", "2:1,1:2,2:1", "--tp-replicated", "", "--json", ""])
    assert [g.pairs for g in args.tp_groups] == [((1, 1), (2, 1), (1, 2))]
    assert args.tokens == 256 and args.layouts == ["smollm2"]
    full = transfer.parse_args([])
    assert [(g.kv_heads, len(g.pairs)) for g in full.tp_groups] == [(4, 8), (2, 5)]
    assert full.json.endswith("bench/results/transfer.json")
    for bad, message in (("3:1", "degree 3 neither divides 4 KV heads"), ("2-1", "is not SENDER:RECEIVER")):
        with pytest.raises(SystemExit):
            transfer.parse_args(["--tp-pairs", bad])
        assert message in capsys.readouterr().err


def test_rank_heads_shard_or_replicate_like_the_engine():
    assert rank_heads(4, 2) == [range(0, 2), range(2, 4)]
    assert rank_heads(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]


def test_a_two_rank_push_into_one_rank_lands_every_head_and_a_wrong_expectation_fails():
    args = transfer.parse_args(["--tokens", "32", "--repeats", "1", "--chunks", "2", "--layouts", "",
                                "--tp-pairs", "2:1", "--tp-replicated", "", "--json", ""])
    ctx = mp.get_context("spawn")
    workers = []
    try:
        workers.append(receiver := transfer.Worker(ctx, receiver_main, "receiver"))
        workers.append(sender := transfer.Worker(ctx, sender_main, "sender"))
        bench = transfer.Bench(sender, receiver, args)
        group = args.tp_groups[0]
        rows, memcpy_s = bench.run_tp(group)

        assert [r.pair for r in rows] == ["1:1", "2:1"]
        base, pair = rows
        assert all(r.verified_ranks == r.dst_degree and len(r.push_s) == len(r.cma_s) == 1 for r in rows)
        block_bytes = group.kv_layout(1).block_bytes
        assert base.kv_bytes == pair.kv_bytes == pair.written_bytes == 2 * block_bytes
        # the one receiving rank's heads come from both sending ranks: packed into its layout in
        # staging, one whole-block region per block (counted from the writes posted), where the
        # per-row path posts one per (layer, K/V, token) row and sending rank
        assert base.regions_per_block == pair.regions_per_block == 1 and pair.region_bytes == block_bytes
        assert (base.staged_ranks, pair.staged_ranks) == (0, 1)
        assert base.row_regions_per_block == 1 and pair.row_regions_per_block == 2 * 30 * 16 * 2
        assert base.pack_s == [] and len(pair.pack_s) == 1 and base.pack_ms is None
        assert len(memcpy_s) == 1
        table = transfer.render_tp(args, dict(blocks=2, chunks=2, seed=0), [(group, rows, memcpy_s)])
        assert "SmolLM2 shape, 4 KV heads" in table and "2:1" in table

        # the check is real: the same push judged against the wrong heads fails
        bench.incarnation += 1
        layout = transfer.asdict(group.kv_layout(2 * bench.num_blocks))
        rx = receiver.call("tp_setup", layout=layout, names={1: "decode-w-9"})
        sender.call("tp_setup", layout=layout, seed=args.seed, names={2: "prefill-w-9"})
        sender.call("tp_connect", infos=rx["infos"], pid=rx["pid"], timeout_s=args.timeout)
        assert bench.tp_push(2, 1, "right", None, [[0, 4]]) > 0
        with pytest.raises(RuntimeError, match=r"receiving rank\(s\) \[0\] do not hold their KV heads"):
            bench.tp_push(2, 1, "wrong", None, [[2, 2]])
        with pytest.raises(RuntimeError, match="posted 2 regions where the bench accounts for 3"):
            bench.tp_push(2, 1, "miscounted", None, None, regions=3)
    finally:
        for w in reversed(workers):
            w.close()
