"""Prefix-cache block hashes: a chain over full blocks of token ids, salted per tenant.
The engine's KV pool finds cached blocks by them; the gateway's router routes by them."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one block: depends on the parent block's hash and this block's tokens.

    Stable across processes and Python runs (no `hash()`): blake2b with a 16-byte digest
    over a marker byte, the parent hash (if any) and the token ids as little-endian int64.
    """
    h = hashlib.blake2b(digest_size=16)
    # The marker keeps "no parent" distinct from any 16-byte parent hash.
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    h.update(tokens.tobytes())
    return h.digest()


def salt_root(salt: str) -> bytes | None:
    """The parent of a request's first block: None with no salt (shared by everyone), else a
    hash of the salt, so that only requests with the same salt find each other's blocks (a
    tenant cannot probe, block by block, what another tenant's prompts began with)."""
    if not salt:
        return None
    return hashlib.blake2b(b"\x02" + salt.encode(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`; a trailing partial block is skipped."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: must be positive")
    hashes: list[bytes] = []
    parent: bytes | None = salt_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
