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
    return inv_freq


class RotaryEmbedding:
    """A cos/sin table for every position up to `max_positions`, indexed per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for each token, [num_tokens, 1, head_dim]; computed once per step."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

