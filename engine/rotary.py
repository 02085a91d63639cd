"""Rotary position embeddings (rotate-half form), with the checkpoint's theta and scaling.

Frequencies and the cos/sin table are computed in float32 exactly as Hugging Face does,
then cast to the model dtype, so positions round the same way as the reference. Applying
them is the op set's `rotary` (kernels.reference.rotary on CPU).
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        inv_freq = _yarn(rope, head_dim)
    return inv_freq


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's blend of interpolated (divided by the factor) and extrapolated frequencies: a
    linear ramp over the dimensions whose rotations fall between beta_fast and beta_slow
    within the original context (transformers' _compute_yarn_parameters, term by term)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding:
    """A cos/sin table for every position up to `max_positions`, indexed per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        # YaRN scales both by its attention factor (1 for every other type: no rounding added)
        scale = rope.attention_factor
        self.cos = (emb.cos() * scale if scale != 1.0 else emb.cos()).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale if scale != 1.0 else emb.sin()).to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for each token, [num_tokens, 1, head_dim]; computed once per step."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

