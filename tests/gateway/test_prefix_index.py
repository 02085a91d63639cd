"""The gateway's prefix index: per-worker sets fed by their events, longest prefix per
candidate, a new incarnation's or a gone worker's entries dropped, a bound that drops whole
workers, and salted hashes that never match another tenant's prompt."""

from __future__ import annotations

from common.block_hash import block_hashes
from common.kv_events import KVEventsSince
from gateway.routing.prefix_index import PrefixIndex

PROMPT = list(range(64))
HASHES = block_hashes(PROMPT, 16)  # 4 blocks


def test_longest_prefix_counts_leading_blocks_held_in_a_row():
    index = PrefixIndex()
    index.apply("a:1", "prefill-a-1", KVEventsSince(5, True, HASHES[:3], []))
    index.apply("b:1", "prefill-b-1", KVEventsSince(2, True, [HASHES[0], HASHES[2], HASHES[3]], []))
    assert index.longest_prefix(["a:1", "b:1"], HASHES) == {"a:1": 3, "b:1": 1}
    assert index.longest_prefix(["b:1"], HASHES) == {"b:1": 1}
    assert index.cursor("a:1") == ("prefill-a-1", 5, b"")
    index.apply("a:1", "prefill-a-1", KVEventsSince(7, False, [], [HASHES[1]]))
    assert index.longest_prefix(["a:1", "b:1"], HASHES) == {"a:1": 1, "b:1": 1}
    assert index.entries == 5


def test_a_new_incarnation_or_a_gone_worker_leaves_nothing():
    index = PrefixIndex()
    index.apply("a:1", "prefill-a-1", KVEventsSince(5, True, HASHES, []))
    index.apply("a:1", "prefill-a-2", KVEventsSince(1, True, [], []))  # restarted at the same address
    assert index.longest_prefix(["a:1"], HASHES) == {} and index.entries == 0
    assert index.names() == {"a:1": "prefill-a-2"}
    index.apply("a:1", "prefill-a-2", KVEventsSince(2, False, HASHES[:1], []))
    index.retain(["b:1"])
    assert index.entries == 0 and index.cursor("a:1") is None


def test_past_the_bound_a_whole_worker_is_dropped_then_resynced():
    index = PrefixIndex(max_entries=5)
    index.apply("a:1", "prefill-a-1", KVEventsSince(1, True, HASHES, []))
    index.apply("b:1", "prefill-b-1", KVEventsSince(1, True, HASHES, []))  # 8 > 5: b's set is not kept
    assert index.entries == 4 and index.size("b:1") == 0
    assert index.cursor("b:1") is None  # it is asked for its whole set again
    index.apply("b:1", "prefill-b-1", KVEventsSince(3, False, HASHES[:1], []))  # an answer to an older cursor
    assert index.size("b:1") == 0
    index.apply("a:1", "prefill-a-1", KVEventsSince(2, False, [], HASHES[2:]))
    index.apply("b:1", "prefill-b-1", KVEventsSince(4, True, HASHES[:3], []))  # room now
    assert index.longest_prefix(["a:1", "b:1"], HASHES) == {"a:1": 2, "b:1": 3}
    assert index.entries == 5


def test_another_tenants_salted_prompt_matches_nothing():
    index = PrefixIndex()
    index.apply("a:1", "prefill-a-1", KVEventsSince(1, True, block_hashes(PROMPT, 16, "tenant-x"), []))
    assert index.longest_prefix(["a:1"], block_hashes(PROMPT, 16, "tenant-x")) == {"a:1": 4}
    assert index.longest_prefix(["a:1"], block_hashes(PROMPT, 16, "tenant-y")) == {}
    assert index.longest_prefix(["a:1"], HASHES) == {}


def test_longest_prefix_equals_each_workers_own_walk_on_random_sets():
    import random

    rng = random.Random(0)
    hashes = block_hashes(list(range(40 * 16)), 16)
    for _ in range(200):
        index, sets = PrefixIndex(), {}
        for w in range(rng.randint(1, 6)):
            held = [h for h in hashes if rng.random() < 0.9]
            sets[f"w:{w}"] = set(held)
            index.apply(f"w:{w}", f"decode-{w}-1", KVEventsSince(1, True, held, []))
        candidates = [a for a in sets if rng.random() < 0.8]
        want = {}
        for a in candidates:
            run = next((i for i, h in enumerate(hashes) if h not in sets[a]), len(hashes))
            if run:
                want[a] = run
        assert index.longest_prefix(candidates, hashes) == want
