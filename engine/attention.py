"""One step's attention metadata, built for the model's op set.

A step's tokens are laid out decodes first (one token each, ascending context length),
then prefill chunks (kernels/attention_step.py has the types and the layout). The op set
groups the decodes its own way (`OpSet.plan_decodes`), once per step; every layer then
hands the same `AttentionMetadata` to `OpSet.attention_step`.
"""

from __future__ import annotations

import torch

from engine.step_buffers import StepInputs
from kernels.attention_step import AttentionMetadata, PrefillSpan, StepDecodes
from kernels.op_set import OpSet


def step_attention(
    ops: OpSet,
    step: StepInputs,
    decode_widths: list[int],  # blocks in each decode's table
    decode_lens: list[int],  # each decode's context length (ascending)
    prefills: list[PrefillSpan],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    decodes = StepDecodes(step.decode_block_tables, step.decode_context_lens, decode_lens, decode_widths, block_size)
    return AttentionMetadata(
        slot_blocks=step.slot_blocks.to(device),
        slot_offsets=step.slot_offsets.to(device),
        decodes=ops.plan_decodes(decodes, device),
        prefills=prefills,
    )
