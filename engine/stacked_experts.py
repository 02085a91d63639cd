"""A checkpoint's experts stored stacked, one tensor per layer for all of them (gpt-oss), as
the per-expert tensors the model holds (engine/moe.py's `Expert`: gate|up fused, rows first).

gpt-oss stores `mlp.experts.gate_up_proj` as [experts, hidden, 2 * ffn] with gate and up
interleaved column by column, `down_proj` as [experts, ffn, hidden], and a bias beside each;
its released checkpoints store the two weights in MXFP4 instead (`_blocks`: two 4-bit values
a byte, 32 to a block; `_scales`: one power-of-two exponent a block, biased by 127), which is
dequantized here, one expert at a time, exactly (every MXFP4 value is a bfloat16 too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
# The sixteen values of an MXFP4 nibble (e2m1), low nibble first in each byte.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_stacked(name: str) -> bool:
    return _STACKED.fullmatch(name) is not None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., rows, groups, 16] uint8, scales [..., rows, groups] uint8 -> [..., groups * 32,
    rows] float32: the stored layout's transpose, as the unquantized checkpoint has it."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2).transpose(-1, -2)


class StackedExperts:
    """Collects a checkpoint's stacked expert tensors, then yields them per expert."""

    def __init__(self) -> None:
        self._parts: dict[tuple[int, str, str], torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        layer, proj, kind = _STACKED.fullmatch(name).groups()
        self._parts[int(layer), proj, kind or ""] = tensor

    def per_expert(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our parameter name, its tensor) for every expert of every layer collected."""
        for (layer, proj, kind), tensor in sorted(self._parts.items()):
            if kind == "_scales":
                continue
            name = f"layers.{layer}.moe.experts.{{}}.{proj}.{'bias' if kind == '_bias' else 'weight'}"
            for e in range(tensor.shape[0]):
                if kind == "_blocks":
                    value = dequantize_mxfp4(tensor[e], self._scales(layer, proj)[e])
                else:
                    value = tensor[e]
                yield name.format(e), _ours(proj, kind, value)

    def _scales(self, layer: int, proj: str) -> torch.Tensor:
        scales = self._parts.get((layer, proj, "_scales"))
        if scales is None:
            raise ValueError(f"layer {layer} {proj}: MXFP4 blocks without their scales")
        return scales


def _ours(proj: str, kind: str, value: torch.Tensor) -> torch.Tensor:
    """One expert's stored tensor in the model's layout: weights [out, in]; gate|up de-interleaved."""
    if kind != "_bias":
        value = value.t()  # stored [in, out]
    if proj == "gate_up_proj":  # gate at even columns, up at odd ones -> gate rows, then up rows
        value = torch.cat([value[0::2], value[1::2]])
    return value.contiguous()
