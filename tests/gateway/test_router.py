"""The gateway's routing decisions (pure Python: no workers needed)."""

from __future__ import annotations

from gateway.routing.router import OVERLOAD_TOKENS, Router

PREFILL = [f"10.0.0.{i}:50051" for i in range(1, 5)]


def _prompt(seed: int, n: int = 80) -> list[int]:
    return [(seed * 7919 + i * 31) % 49152 for i in range(n)]


def test_a_shared_prefix_lands_on_the_same_prefill_worker_and_prompts_spread():
    r = Router(["d:1"], PREFILL)
    system = _prompt(1, 64)  # four full blocks decide the favourite
    favourites = {r.rank_prefill(system + _prompt(100 + i, 20))[0] for i in range(20)}
    assert len(favourites) == 1
    spread = {r.rank_prefill(_prompt(i))[0] for i in range(200)}
    assert spread == set(PREFILL)
    assert sorted(r.rank_prefill(system)) == sorted(PREFILL)  # every worker ranked: fallbacks


def test_an_overloaded_favourite_yields_to_the_least_loaded():
    r = Router(["d:1"], PREFILL)
    prompt = _prompt(3)
    ranked = r.rank_prefill(prompt)
    favourite = next(w for w in r.prefill if w.address == ranked[0])
    favourite.waiting_tokens = OVERLOAD_TOKENS // 2  # busy, not overloaded: affinity wins
    assert r.rank_prefill(prompt) == ranked
    favourite.waiting_tokens = OVERLOAD_TOKENS + 1
    for w in r.prefill:
        if w is not favourite:
            w.waiting_tokens = 0 if w.address == ranked[2] else 100
    assert r.rank_prefill(prompt)[0] == ranked[2]
    assert set(r.rank_prefill(prompt)) == set(PREFILL)


def test_unhealthy_workers_are_skipped():
    r = Router(["d:1", "d:2"], PREFILL)
    r.prefill[0].healthy = False
    assert PREFILL[0] not in r.rank_prefill(_prompt(5))
    r.decode[0].healthy = False
    assert r.pick_decode().address == "d:2"
    r.decode[1].healthy = False
    assert r.pick_decode().address in {"d:1", "d:2"}  # none healthy: still somewhere to try


def test_decode_prefers_kv_headroom_then_fewest_outstanding_tokens():
    r = Router(["d:1", "d:2"], [])
    a, b = r.decode
    a.observe(free_blocks=100, total_blocks=100, block_size=16, waiting_tokens=0)
    b.observe(free_blocks=10, total_blocks=100, block_size=16, waiting_tokens=0)
    b.outstanding_tokens, a.outstanding_tokens = 0, 500
    assert r.pick_decode(100).address == "d:2"  # both have room: the less loaded
    assert r.pick_decode(400).address == "d:1"  # only a has room for 400 tokens
    assert r.kv_room(400) and not r.kv_room(2000)
    a.kv_claimed_tokens = 1500  # prompts sent since the last Stats count against the headroom
    assert not r.kv_room(400)
    a.observe(free_blocks=100, total_blocks=100, block_size=16, waiting_tokens=800)  # queued prompts too
    assert not a.fits(1000) and a.fits(800)
    assert r.kv_capacity() == 1600


def test_a_claim_ends_with_its_request_not_at_the_next_stats():
    """A long prompt's KV, seen taken by a Stats while it ran, is room again once it ended:
    the next long prompt, sent right after, fits (its blocks are cached, hence evictable)."""
    r = Router(["d:1"], [])
    (w,) = r.decode
    w.observe(free_blocks=400, total_blocks=400, block_size=16, waiting_tokens=0)
    w.kv_claimed_tokens += 4650  # the first long prompt is sent
    assert not w.fits(4650) and w.fits(6400 - 4650)
    w.observe(free_blocks=400 - 291, total_blocks=400, block_size=16, waiting_tokens=0)  # a Stats while it runs
    assert not r.kv_room(4646)
    w.end_claim(4650, freed=True)  # it ended there (its last message came): its blocks are free (cached)
    assert r.kv_room(4646) and w.kv_room_tokens == 109 * 16 + 4650


def test_a_cut_requests_claim_ends_with_the_next_stats_asked_for_after_it():
    """A stream its client cut: the worker frees its blocks once the abort lands, so they
    count as taken until a Stats asked for after the cut; one asked before changes nothing."""
    import time

    r = Router(["d:1"], [])
    (w,) = r.decode
    w.observe(free_blocks=400, total_blocks=400, block_size=16, waiting_tokens=0)
    w.kv_claimed_tokens += 4650
    before = time.monotonic()
    w.observe(free_blocks=109, total_blocks=400, block_size=16, waiting_tokens=0, asked_at=before)
    w.end_claim(4650, freed=False)
    assert not r.kv_room(4646) and w.kv_claimed_tokens == 0
    w.observe(free_blocks=109, total_blocks=400, block_size=16, waiting_tokens=0, asked_at=before)  # asked before
    assert not r.kv_room(4646)
    w.observe(free_blocks=400, total_blocks=400, block_size=16, waiting_tokens=0, asked_at=time.monotonic())
    assert r.kv_room(4646) and w.kv_ending == []


def test_headroom_is_unknown_until_the_first_stats():
    r = Router(["d:1"], [])
    assert r.kv_room(10**6) and r.kv_capacity() is None


def test_decode_counts_the_prefix_a_worker_holds_as_work_saved_and_names_a_sibling_holding_more():
    from common.block_hash import block_hashes
    from common.kv_events import KVEventsSince

    r = Router(["d:1", "d:2", "d:3"], [])
    a, b, c = r.decode
    prompt = _prompt(9, 100)  # 6 full blocks
    hashes = block_hashes(prompt, 16, "salt")
    r.index.apply("d:2", "decode-2-1", KVEventsSince(1, True, hashes[:6], []))
    r.index.apply("d:3", "decode-3-1", KVEventsSince(1, True, hashes[:2], []))
    assert r.pick_decode(len(prompt), hashes=hashes) is b  # 96 cached tokens: the least work
    assert r.prefix_source(hashes, b) is None  # no one holds more than it
    b.outstanding_tokens = 200  # busy: 200 - 96 > 0 - 32
    assert r.pick_decode(len(prompt), hashes=hashes) is c  # idle, and it holds 2 blocks
    assert r.prefix_source(hashes, c) == ("d:2", 6)  # the sibling holding the most
    assert r.prefix_source(hashes, a) == ("d:2", 6)
    assert r.prefix_source(block_hashes(prompt, 16, "another"), a) is None  # another salt: nobody holds it
    b.healthy = False
    assert r.prefix_source(hashes, a) == ("d:3", 2)  # an unhealthy holder is not named
    assert r.pick_decode(len(prompt)).address == "d:1"  # no hashes: the least outstanding tokens, as before


def test_without_the_index_routing_is_as_before_it():
    from common.block_hash import block_hashes
    from common.kv_events import KVEventsSince

    r = Router(["d:1", "d:2"], [], use_index=False)
    prompt = _prompt(11, 100)
    hashes = block_hashes(prompt, 16)
    r.index.apply("d:2", "decode-2-1", KVEventsSince(1, True, hashes, []))
    assert r.pick_decode(len(prompt), hashes=hashes).address == "d:1"  # the first of two idle workers
    assert r.prefix_source(hashes, r.decode[0]) is None


def test_a_route_is_one_decision_from_one_look_up():
    """Router.route gives the prefill ranking, the decode worker and its prefix source that
    the three separate rules give, walking the prefix index once."""
    from common.block_hash import block_hashes
    from common.kv_events import KVEventsSince

    r = Router(["d:1", "d:2", "d:3"], PREFILL[:2])
    prompt = _prompt(9, 100)
    hashes = block_hashes(prompt, 16, "salt")
    r.index.apply("d:2", "decode-2-1", KVEventsSince(1, True, hashes[:6], []))
    r.index.apply("d:3", "decode-3-1", KVEventsSince(1, True, hashes[:2], []))
    r.index.apply(PREFILL[1], "prefill-1-1", KVEventsSince(1, True, hashes[:3], []))
    r.decode[1].outstanding_tokens = 200
    walks = []
    walk = r.index.longest_prefix
    r.index.longest_prefix = lambda candidates, h: walks.append(1) or walk(candidates, h)
    route = r.route(prompt, "salt", hashes)
    assert len(walks) == 1
    assert route.prefill == r.rank_prefill(prompt, "salt", hashes) and route.prefill[0] == PREFILL[1]
    assert route.decode is r.decode[2] and route.decode is r.pick_decode(len(prompt), hashes=hashes)
    assert route.prefix_source == r.prefix_source(hashes, route.decode) == ("d:2", 6)
    assert r.route(prompt, "salt", hashes, exclude={"d:3"}).decode is r.decode[0]  # a retry passes over d:3
