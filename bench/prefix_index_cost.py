"""What the gateway's prefix index costs (gateway/routing/prefix_index.py): its memory per entry, the
time to apply a worker's KV events, and the time a routing decision takes with the index
against the same decision without it (the rendezvous hash and least-loaded pick alone), in
one run, one process.

    python -m bench.prefix_index_cost [--workers 8] [--blocks 32768] [--prompt-blocks 128] [--json out.json]

The index is filled as a deployment of `--workers` decode and as many prefill workers, each
of whose pools holds `--blocks` distinct block hashes (a full pool of a large worker), half
of them shared prefixes (every worker holds the same system prompts' blocks), the rest its
own. Routing is timed for prompts of `--prompt-blocks` blocks whose leading half some
workers hold: `rank_prefill` and `pick_decode` + `prefix_source`, index on and off
(Router.use_index), interleaved. The block hashes of the prompt are computed once per
request either way (the router needs them for the rendezvous hash too) and timed apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import tracemalloc
from pathlib import Path

from bench.host_cpu import host_cpu
from common.block_hash import block_hashes
from common.kv_events import KVEventsSince
from gateway.routing.router import Router

BS = 16


def _prompt(i: int, n_blocks: int) -> list[int]:
    return [(i * 7919 + t * 31) % 49152 for t in range(n_blocks * BS)]


def _worker_hashes(w: int, blocks: int, shared: list[bytes]) -> list[bytes]:
    own = block_hashes(_prompt(10_000 + w, blocks - len(shared)), BS, salt=f"worker-{w}")
    return shared + own


def _time(fn, reps: int) -> float:
    """Median seconds of one call, over `reps` batches of calls."""
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(50):
            fn()
        per.append((time.perf_counter() - t) / 50)
    return statistics.median(per)


def run(workers: int, blocks: int, prompt_blocks: int) -> dict:
    decode = [f"10.0.0.{i}:50051" for i in range(workers)]
    prefill = [f"10.0.1.{i}:50051" for i in range(workers)]
    shared_prompt = _prompt(1, blocks // 2)
    shared = block_hashes(shared_prompt, BS)
    print(f"filling an index: {2 * workers} workers x {blocks} blocks ({len(shared)} shared)", flush=True)

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    router = Router(decode, prefill)
    sets = {a: _worker_hashes(i, blocks, shared) for i, a in enumerate(decode + prefill)}
    hash_bytes = tracemalloc.get_traced_memory()[0] - before  # the hashes themselves (the workers' lists)
    for a, hs in sets.items():
        router.index.apply(a, f"w-{a}", KVEventsSince(1, True, hs, []))
    index_bytes = tracemalloc.get_traced_memory()[0] - before - hash_bytes
    tracemalloc.stop()
    timed = Router(decode, prefill)  # filled again with tracemalloc off, which slows every allocation
    t = time.perf_counter()
    for a, hs in sets.items():
        timed.index.apply(a, f"w-{a}", KVEventsSince(1, True, hs, []))
    fill_s = time.perf_counter() - t
    del timed
    entries = router.index.entries
    print(f"  {entries} entries, {index_bytes / entries:.0f} B an entry beyond the hash bytes, "
          f"resync {fill_s / entries * 1e9:.0f} ns an entry", flush=True)

    # Incremental rounds: a worker's Stats with 512 stored and 512 removed hashes.
    a0 = decode[0]
    fresh = block_hashes(_prompt(77, 512), BS, salt="fresh")
    old = sets[a0][-512:]
    cursor = [1]

    def round_trip() -> None:
        cursor[0] += 1
        router.index.apply(a0, f"w-{a0}", KVEventsSince(cursor[0], False, fresh, old))
        cursor[0] += 1
        router.index.apply(a0, f"w-{a0}", KVEventsSince(cursor[0], False, old, fresh))
    event_s = _time(round_trip, 5) / 2048

    prompts = [shared_prompt[: prompt_blocks // 2 * BS] + _prompt(500 + i, prompt_blocks - prompt_blocks // 2)
               for i in range(20)]
    hashed = [block_hashes(p, BS) for p in prompts]
    k = [0]

    def hashing() -> None:
        k[0] = (k[0] + 1) % len(prompts)
        block_hashes(prompts[k[0]], BS)

    def route(use_index: bool):
        def one() -> None:
            k[0] = (k[0] + 1) % len(prompts)
            router.use_index = use_index
            p, hs = prompts[k[0]], hashed[k[0]]
            router.rank_prefill(p, "", hs)
            w = router.pick_decode(len(p), hashes=hs)
            router.prefix_source(hs, w)
        return one

    on, off = [], []
    for _ in range(3):  # interleaved: a drift of the host hits both alike
        on.append(_time(route(True), 5))
        off.append(_time(route(False), 5))
    hash_s = _time(hashing, 5)
    result = {
        "host": f"{host_cpu().describe()}, {os.cpu_count()} cores", "workers": 2 * workers,
        "blocks_per_worker": blocks, "entries": entries,
        "bytes_per_entry": index_bytes / entries, "index_mib": index_bytes / 2**20,
        "resync_ns_per_entry": fill_s / entries * 1e9, "event_ns": event_s * 1e9,
        "prompt_blocks": prompt_blocks, "hash_prompt_us": hash_s * 1e6,
        "route_us_index": statistics.median(on) * 1e6, "route_us_no_index": statistics.median(off) * 1e6,
    }
    result["route_ratio"] = result["route_us_index"] / result["route_us_no_index"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="decode workers, and as many prefill workers")
    ap.add_argument("--blocks", type=int, default=32768, help="distinct cached blocks per worker")
    ap.add_argument("--prompt-blocks", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    r = run(args.workers, args.blocks, args.prompt_blocks)
    print(f"host: {r['host']}")
    print(f"index: {r['entries']} entries over {r['workers']} workers, {r['index_mib']:.0f} MiB "
          f"({r['bytes_per_entry']:.0f} B an entry beyond the 16-byte hashes the workers' lists hold)")
    print(f"applying events: {r['event_ns']:.0f} ns an event; a resync {r['resync_ns_per_entry']:.0f} ns an entry")
    print(f"routing a {r['prompt_blocks']}-block prompt: {r['route_us_index']:.1f} us with the index, "
          f"{r['route_us_no_index']:.1f} us without ({r['route_ratio']:.2f}x); hashing the prompt "
          f"{r['hash_prompt_us']:.1f} us (paid either way)")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
