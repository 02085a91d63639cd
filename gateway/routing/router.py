"""Which workers serve a request: the decode worker with the least work among those with KV
headroom for the prompt (its outstanding tokens plus the prompt tokens it would compute,
past the prefix it holds cached; a sibling holding more of the prefix is named as the
chosen worker's prefix source), and the prefill workers ranked by how much of the
prompt's prefix each holds cached (the prefix index the workers' KV events feed:
gateway/routing/prefix_index.py), then by rendezvous hash of the prompt's first full blocks, so a
shared system prompt the index knows nothing of yet keeps landing on the same prefill
worker, unless that worker's queue is much longer than the least-loaded one's: then the
least-loaded goes first."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from common.block_hash import block_hashes
from gateway import metrics
from gateway.routing.circuit_breaker import CircuitBreaker
from gateway.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

AFFINITY_BLOCKS = 4  # how many leading full blocks decide the favourite prefill worker
OVERLOAD_TOKENS = 2048  # a favourite this many queued prompt tokens behind the least-loaded is overloaded


@dataclass
class WorkerState:
    address: str
    outstanding_tokens: int = 0  # prompt + max output tokens of requests in flight via this gateway
    healthy: bool = True
    kv_free_tokens: int | None = None  # free KV slots less queued prompt tokens, at the last Stats (None: unknown)
    kv_total_tokens: int | None = None
    kv_claimed_tokens: int = 0  # prompt tokens of this gateway's requests on this worker now
    # Requests that ended without their last message (aborted, failed: the worker frees their
    # blocks a little later), as (when, prompt tokens): taken until a Stats asked for after.
    kv_ending: list[tuple[float, int]] = field(default_factory=list)
    kv_claimed_at_stats: int = 0  # ... both when the last Stats came: its free count had them taken already
    waiting_tokens: int = 0  # queued prompt tokens at the last Stats
    longest_step_s: float = 0.0  # the longest engine step it measured (its deep health's answer)
    max_sequences: int | None = None  # running plus queued requests it holds at most (None: not reported)
    name: str | None = None  # role-worker_id-incarnation, from its Stats: how clients see it (None: not yet)
    # requests that fail on it in a row take it out of routing for a while (decode workers)
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(2.0))

    def end_claim(self, tokens: int, freed: bool) -> None:
        """A request's claim ends: its blocks are room again at once when it ended on the
        worker (`freed`: its last message came), else from the next Stats asked for after now."""
        self.kv_claimed_tokens -= tokens
        if not freed:
            self.kv_ending.append((time.monotonic(), tokens))

    def observe(self, free_blocks: int, total_blocks: int, block_size: int, waiting_tokens: int,
                asked_at: float = math.inf, max_sequences: int = 0) -> None:
        """A fresh Stats, asked for at `asked_at`: its free blocks (cached ones included: they
        are evicted on demand) already count the requests claimed before it, and the ending
        ones it was asked for after are its business now. `max_sequences`: its max_num_seqs +
        max_waiting (0: a worker that does not report them)."""
        self.max_sequences = max_sequences or None
        self.kv_free_tokens = free_blocks * block_size - waiting_tokens
        self.kv_total_tokens = total_blocks * block_size
        self.kv_ending = [(t, n) for t, n in self.kv_ending if t >= asked_at]
        self.kv_claimed_at_stats = self._taken()
        self.waiting_tokens = waiting_tokens

    def _taken(self) -> int:
        return self.kv_claimed_tokens + sum(n for _, n in self.kv_ending)

    @property
    def kv_room_tokens(self) -> int | None:
        """Free KV now, as far as this gateway knows: the last Stats's, less the prompts sent
        here since, plus those of its requests that ended since (a claim ends with its
        request, not at the next Stats)."""
        if self.kv_free_tokens is None:
            return None
        return self.kv_free_tokens + self.kv_claimed_at_stats - self._taken()

    def fits(self, prompt_tokens: int) -> bool:
        """Room in the KV cache for this prompt now (True while unknown)."""
        room = self.kv_room_tokens
        return room is None or room >= prompt_tokens


class PoolSize(NamedTuple):
    """What the decode pool holds at most: running plus queued sequences, summed over the
    workers that reported theirs."""

    sequences: int
    workers: int


class Route(NamedTuple):
    """Where one request goes: the prefill workers its decode worker tries, most preferred
    first; the decode worker; and the sibling it may fetch prompt blocks from, as
    (address, blocks it holds in a row), or None."""

    prefill: list[str]
    decode: WorkerState
    prefix_source: tuple[str, int] | None


class NoWorker(LookupError):
    """No decode worker is known (membership not pushed yet, or every one was removed)."""


class Router:
    def __init__(self, decode: list[str], prefill: list[str], block_size: int = 16, use_index: bool = True,
                 breaker_cool_down_s: float = 2.0):
        self.decode: list[WorkerState] = []
        self.prefill: list[WorkerState] = []
        self.block_size = block_size
        self.breaker_cool_down_s = breaker_cool_down_s  # a worker's first cool-down: the health interval
        self.index = PrefixIndex()
        self.use_index = use_index  # False: route as before the index (the index is still fed)
        self.set_workers(decode, prefill)

    def set_workers(self, decode: list[str], prefill: list[str]) -> None:
        """New membership (from the config or the controller); known workers keep their state."""
        known = {w.address: w for w in self.decode + self.prefill}
        self.decode = [known.get(a) or self._state(a) for a in dict.fromkeys(decode)]
        self.prefill = [known.get(a) or self._state(a) for a in dict.fromkeys(prefill)]
        self.index.retain(w.address for w in self.decode + self.prefill)

    def _state(self, address: str) -> WorkerState:
        return WorkerState(address, breaker=CircuitBreaker(self.breaker_cool_down_s))

    def route(self, prompt: Sequence[int], cache_salt: str, hashes: Sequence[bytes],
              exclude: set[str] = frozenset()) -> Route:
        """A request's whole route from one look-up in the prefix index: the prefill workers
        ranked (`rank_prefill`'s rule), the decode worker (`pick_decode`'s, passing over
        `exclude`) and a sibling holding more of the prompt as its prefix source
        (`prefix_source`'s), each from the blocks the one walk found each worker holding."""
        addresses = [w.address for w in self.decode + self.prefill]
        matched = self.index.longest_prefix(addresses, hashes) if hashes and self.use_index else {}
        decode = self._pick_decode(len(prompt), exclude, matched, bool(hashes) and self.use_index)
        return Route(self._rank_prefill(prompt, cache_salt, hashes, matched), decode,
                     self._prefix_source(decode, matched) if hashes else None)

    def pick_decode(self, prompt_tokens: int = 0, exclude: set[str] = frozenset(),
                    hashes: Sequence[bytes] = ()) -> WorkerState:
        """The decode worker `route` would pick, alone (a replay's, which names no prefix)."""
        addresses = [w.address for w in self.decode]
        matched = self.index.longest_prefix(addresses, hashes) if hashes and self.use_index else {}
        return self._pick_decode(prompt_tokens, exclude, matched, bool(hashes) and self.use_index)

    def _pick_decode(self, prompt_tokens: int, exclude: set[str], matched: dict[str, int],
                     by_prefix: bool) -> WorkerState:
        """The healthy decode worker with the least work, preferring those with KV headroom for
        the prompt (any worker, if none is healthy), and passing over those whose circuit
        breaker is open while another can serve. Work is its outstanding tokens plus the
        prompt's tokens it would compute: those past the leading blocks it holds cached
        (`matched`, from the prefix index under the request's cache salt). With nothing in
        the index for the prompt, the least outstanding tokens decide, as before. The pick
        counts as its breaker's probe when the breaker lets one through."""
        if not self.decode:
            raise NoWorker("no decode worker")
        candidates = [w for w in self.decode if w.address not in exclude] or self.decode
        candidates = [w for w in candidates if w.breaker.allows()] or candidates
        live = [w for w in candidates if w.healthy] or candidates
        roomy = [w for w in live if w.fits(prompt_tokens)] or live
        bs = self.block_size
        pick = min(roomy, key=lambda w: w.outstanding_tokens - matched.get(w.address, 0) * bs)
        pick.breaker.picked()
        if by_prefix:
            by = "index" if matched.get(pick.address) else "load"
            metrics.PREFIX_ROUTES.labels("decode", by).inc()
            metrics.PREFIX_MATCHED_BLOCKS.labels("decode").inc(matched.get(pick.address, 0))
        return pick

    def prefix_source(self, hashes: Sequence[bytes], chosen: WorkerState) -> tuple[str, int] | None:
        """`route`'s prefix source for `chosen`, alone."""
        if not hashes or not self.use_index:
            return None
        return self._prefix_source(chosen, self.index.longest_prefix([w.address for w in self.decode], hashes))

    def _prefix_source(self, chosen: WorkerState, held: dict[str, int]) -> tuple[str, int] | None:
        """Another healthy decode worker holding more of the prompt's leading blocks than
        `chosen` does, as (address, blocks it holds in a row): where `chosen` may fetch them
        from instead of computing them (worker/prefix_fetch.py). None when no one holds more."""
        others = [w.address for w in self.decode if w is not chosen and w.healthy]
        if not others or not self.use_index:
            return None
        best = max(others, key=lambda a: held.get(a, 0))
        if held.get(best, 0) <= held.get(chosen.address, 0):
            return None
        return best, held[best]

    def kv_room(self, prompt_tokens: int) -> bool:
        """Some healthy decode worker has KV headroom for the prompt now (True with none
        known: that is a 503 of its own, not an overload)."""
        if not self.decode:
            return True
        live = [w for w in self.decode if w.healthy] or self.decode
        return any(w.fits(prompt_tokens) for w in live)

    def decode_pool_size(self) -> PoolSize | None:
        """What the healthy decode workers hold at most (max_num_seqs + max_waiting each, as
        their last Stats said; every worker's when none is healthy); None until one reported.
        Past it the workers refuse requests themselves (a full queue), so a limit at this size
        never refuses what the pool could have taken."""
        live = [w for w in self.decode if w.healthy] or self.decode
        sizes = [w.max_sequences for w in live if w.max_sequences is not None]
        return PoolSize(sum(sizes), len(sizes)) if sizes else None

    def slowest_decode_step_s(self) -> float:
        """The longest step any decode worker measured (0.0 while none said)."""
        return max((w.longest_step_s for w in self.decode), default=0.0)

    def kv_capacity(self) -> int | None:
        """The largest decode worker's whole KV cache in tokens (None while unknown)."""
        known = [w.kv_total_tokens for w in self.decode if w.kv_total_tokens is not None]
        return max(known) if known else None

    def name_of(self, address: str) -> str | None:
        """The worker's name (role-worker_id-incarnation) as its last Stats said; None if unknown."""
        for w in self.decode + self.prefill:
            if w.address == address:
                return w.name
        return None

    def has_other_decode(self, worker: WorkerState) -> bool:
        return any(w is not worker for w in self.decode)

    def rank_prefill(self, prompt: list[int], cache_salt: str = "", hashes: Sequence[bytes] | None = None) -> list[str]:
        """`route`'s prefill ranking, alone."""
        if hashes is None:
            hashes = block_hashes(prompt, self.block_size, cache_salt)
        addresses = [w.address for w in self.prefill]
        matched = self.index.longest_prefix(addresses, hashes) if hashes and self.use_index else {}
        return self._rank_prefill(prompt, cache_salt, hashes, matched)

    def _rank_prefill(self, prompt: Sequence[int], cache_salt: str, hashes: Sequence[bytes],
                      matched: dict[str, int]) -> list[str]:
        """Prefill workers, the prompt's favourite first (healthy ones only): the most of the
        prompt's leading blocks cached first (`matched`, from the prefix index), then by
        rendezvous hash of the first blocks. Both use the prompt's block hashes under the
        request's cache salt: the same blocks the worker's prefix cache would find."""
        live = [w for w in self.prefill if w.healthy]
        if not live:
            return []
        key = b"".join(hashes[:AFFINITY_BLOCKS]) or bytes(f"{cache_salt}{list(prompt[:8])}", "utf-8")
        ranked = sorted(live, key=lambda w: (matched.get(w.address, 0), _score(key, w.address)), reverse=True)
        least = min(ranked, key=lambda w: w.waiting_tokens)
        overloaded = ranked[0].waiting_tokens - least.waiting_tokens > OVERLOAD_TOKENS
        if overloaded:
            ranked.remove(least)
            ranked.insert(0, least)
        first = ranked[0].address
        by = "load" if overloaded else "index" if matched.get(first) else "hash"
        metrics.PREFIX_ROUTES.labels("prefill", by).inc()
        metrics.PREFIX_MATCHED_BLOCKS.labels("prefill").inc(matched.get(first, 0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefill ranked by %s: %s first, %d of %d blocks cached there (index: %s)", by, first,
                      matched.get(first, 0), len(hashes), matched or "nothing for this prompt")
        return [w.address for w in ranked]


def _score(key: bytes, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "big")
