"""The persistent step buffers (engine/step_buffers.py): each step's views hold exactly that
step's inputs, whatever the steps before wrote, and a step past the limits grows them."""

from __future__ import annotations

from engine.step_buffers import StepBuffers, StepLimits


def _check(step, ids, positions, blocks, tables, lens, block_size):
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == positions
    assert step.slot_blocks.tolist() == blocks
    assert step.slot_offsets.tolist() == [p % block_size for p in positions]
    assert step.decode_context_lens.tolist() == lens
    assert step.decode_block_tables.shape[0] == len(tables)
    for row, table in zip(step.decode_block_tables.tolist(), tables):
        assert row[: len(table)] == table


def test_each_step_reads_its_own_inputs_after_a_larger_one():
    buffers = StepBuffers(StepLimits(max_tokens=8, max_seqs=4, max_blocks=4), block_size=4)
    big = buffers.fill([5, 6, 7, 8, 9], [9, 3, 0, 1, 2], [2, 0, 1, 1, 1], [[7, 1, 2], [0]], [10, 4])
    _check(big, [5, 6, 7, 8, 9], [9, 3, 0, 1, 2], [2, 0, 1, 1, 1], [[7, 1, 2], [0]], [10, 4], 4)
    small = buffers.fill([11], [4], [3], [[6, 3]], [5])
    _check(small, [11], [4], [3], [[6, 3]], [5], 4)
    empty = buffers.fill([1, 2], [0, 1], [4, 4], [], [])  # a prefill chunk alone: no decode rows
    assert empty.decode_block_tables.shape[0] == 0 and empty.decode_context_lens.numel() == 0
    assert empty.input_ids.tolist() == [1, 2]


def test_a_step_past_the_limits_grows_the_buffers():
    buffers = StepBuffers(StepLimits(max_tokens=2, max_seqs=1, max_blocks=1), block_size=16)
    ids = list(range(10))
    tables = [[i, i + 1, i + 2] for i in range(3)]
    step = buffers.fill(ids, ids, [0] * 10, tables, [33, 34, 35])
    _check(step, ids, ids, [0] * 10, tables, [33, 34, 35], 16)
    assert buffers.limits == StepLimits(max_tokens=10, max_seqs=3, max_blocks=3)
