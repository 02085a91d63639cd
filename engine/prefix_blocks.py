"""A prompt's leading blocks in an engine's KV pool, as a cross-worker prefix fetch sees them
(worker/prefix_fetch.py on the worker that fetches, decode/kv_source.py on the one that
holds): which of them the pool finds in a row, pinned while a push reads or writes them,
blocks allocated for a push to fill, and those made findable under their hashes.

Bookkeeping on the engine's block pool (engine/block_pool.py), no tensors; the caller is
the engine's own thread. A pin is a holder like a request's: `touch` takes the block out of
the free queue, so no allocation can evict or overwrite it, and `unpin` gives it back (to
the LRU's tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

__all__ = ["adopt", "allocate", "held_run", "pin", "unpin"]


def held_run(engine: LLMEngine, hashes: Sequence[bytes], first: int = 0, limit: int | None = None) -> list[int]:
    """The blocks the pool finds for hashes[first:], in a row from `first`, at most `limit`."""
    pool = engine.kv_manager.pool
    end = len(hashes) if limit is None else min(len(hashes), first + limit)
    blocks = []
    for h in hashes[first:end]:
        block_id = pool.lookup(h)
        if block_id is None:
            break
        blocks.append(block_id)
    return blocks


def pin(engine: LLMEngine, blocks: Sequence[int]) -> None:
    engine.kv_manager.pool.touch(blocks)


def allocate(engine: LLMEngine, n: int) -> list[int] | None:
    """`n` blocks for a push to fill, held until `unpin` (None, nothing taken, when fewer are free)."""
    return engine.kv_manager.pool.allocate(n)


def unpin(engine: LLMEngine, blocks: Sequence[int]) -> None:
    """Release pins (or allocated blocks), the last block first: a prefix's head is evicted
    last, as when a request frees its table."""
    engine.kv_manager.pool.free(reversed(list(blocks)))


def adopt(engine: LLMEngine, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
    """Blocks a push filled, findable under their hashes (in order, each chained on the one
    before); returns how many the pool now finds under them (another block may have been
    cached under the same hash meanwhile: that one is kept, and this block stays unhashed)."""
    pool = engine.kv_manager.pool
    found = 0
    for block_id, h in zip(blocks, hashes):
        pool.cache_block(block_id, h)
        found += pool.lookup(h) is not None
    return found
