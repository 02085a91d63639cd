"""Counter-based random numbers for seeded sampling: murmur3_32 on int64 tensors.

A seeded request's draws depend only on (seed, output position, token id), never on what
else shares the batch or ran before, and are computed for a whole sub-batch at once.
"""

from __future__ import annotations

import torch

# 32-bit murmur3 arithmetic on int64 tensors. Values stay in [0, 2**32); products are split
# so no intermediate exceeds 2**48, which keeps int64 free of overflow on every backend.
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) and a constant c < 2**32."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur_word(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mix one 32-bit word k into the murmur3_32 state h."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_exponentials(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Exp(1) draws that depend only on (seed, position, token id): murmur3_32 of the words
    (seed low, seed high, position, token id) -> 23-bit uniform u in (0, 1) -> -log(u).

    seeds, positions: [num_seeded] int64. Returns [num_seeded, vocab_size] float32, all > 0.
    """
    h = torch.zeros_like(seeds)  # murmur3 hash seed 0; the request seed is data
    for word in (seeds & _M32, seeds >> 32, positions & _M32):
        h = _murmur_word(h, word)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [vocab]
    h = _fmix32(_murmur_word(h[:, None], tokens[None, :]) ^ 16)  # 16 bytes hashed
    # 23 bits so that (k + 0.5) is exact in float32 and u < 1 strictly.
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -u.log()
