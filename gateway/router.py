"""Which workers serve a request: the decode worker with the least outstanding tokens, and
the prefill workers ranked by rendezvous hash of the prompt's first full blocks, so a
shared system prompt keeps landing on the same prefill worker's prefix cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.block_pool import block_hashes

AFFINITY_BLOCKS = 4  # how many leading full blocks decide the favourite prefill worker


@dataclass
class WorkerState:
    address: str
    outstanding_tokens: int = 0  # prompt + max output tokens of requests in flight via this gateway
    healthy: bool = True


class Router:
    def __init__(self, decode: list[str], prefill: list[str], block_size: int = 16):
        if not decode:
            raise ValueError("at least one decode worker is needed")
        self.decode = [WorkerState(a) for a in decode]
        self.prefill = [WorkerState(a) for a in prefill]
        self.block_size = block_size

    def pick_decode(self, exclude: set[str] = frozenset()) -> WorkerState:
        """The healthy decode worker with the least outstanding tokens (any, if none is healthy)."""
        candidates = [w for w in self.decode if w.address not in exclude] or self.decode
        live = [w for w in candidates if w.healthy] or candidates
        return min(live, key=lambda w: w.outstanding_tokens)

    def has_other_decode(self, worker: WorkerState) -> bool:
        return any(w is not worker for w in self.decode)

    def rank_prefill(self, prompt: list[int]) -> list[str]:
        """Prefill workers, the prompt's favourite first (healthy ones only)."""
        live = [w for w in self.prefill if w.healthy]
        if not live:
            return []
        key = b"".join(block_hashes(prompt, self.block_size)[:AFFINITY_BLOCKS]) or bytes(str(prompt[:8]), "ascii")
        return [w.address for w in sorted(live, key=lambda w: _score(key, w.address), reverse=True)]


def _score(key: bytes, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "big")
