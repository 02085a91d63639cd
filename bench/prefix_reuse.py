"""What the cluster-wide prefix index, the cross-worker fetch and the disk tier save on a
multi-turn chat workload, against routing as before, in one run.

    python -m bench.prefix_reuse [--configs before,index,after] [--conversations 16] [--turns 8]
                                 [--prefill 0] [--kv-blocks 256] [--quick] [--json out.json]

Each configuration is a fresh `pdserve serve` (SmolLM2, two decode workers; aggregated by
default, so the decode workers compute the prompts; `--prefill 1` adds a prefill worker)
given the same workload, one after the other:

- `before`: `--no-prefix-routing`, no disk tier: decode workers are picked by least
  outstanding tokens, prefill workers by rendezvous hash, and no prefix source is named,
  so nothing is fetched; each worker's own prefix cache still serves what it holds.
- `index`: prefix routing on (the default): a decode worker's outstanding tokens count
  less the prefix the gateway's index says it holds, and a sibling holding more of the
  prompt's prefix is named as the chosen worker's prefix source, which it fetches over
  NIXL instead of computing (when its measured rate predicts the push cheaper).
- `after`: as `index`, plus `--kv-disk-dir`: each worker writes the blocks its pool evicts
  to a disk tier and reads them back on a hit.

The workload (bench/harness/conversations.py): `--conversations` conversations, each with one
of `--system-prompts` long system prompts, `--turns` turns each resending the whole
conversation (system, earlier user turns and answers, a new user message), greedy answers
of at most `--max-tokens` tokens. Round t sends every conversation's turn t in a seeded
order, `--concurrency` in flight, so both decode workers are busy and a conversation's next
turn often finds the worker that holds it busier than the other. The workers' pools are
sized (`--kv-blocks` each) far below the workload's distinct prefixes, so they evict.

Measured per configuration: TTFT p50 / p90 (client side: the first SSE chunk with
content), the workload's wall time, prompt tokens sent, and prompt tokens computed, two
ways: from the answers (usage.prompt_tokens less prompt_tokens_details.cached_tokens) and
from the deployment's /metrics (the decode workers' pdserve_engine_prompt_tokens_total less
their pdserve_engine_prefix_cache_hit_tokens_total, read after a warm-up and at the end;
with a prefill pool the uncached part of a remotely prefilled prompt counts there too,
though its KV came over from the prefill worker, and the prefill workers' own count is a
row of its own); hits by tier, the fetches' outcomes, the gateway's routes and the disk
tier's counters, all from /metrics. Answers are compared turn by turn between every pair
of configurations (reported, not asserted: KV brought from another tier, or a prompt
computed in other chunks or batches, may change the numerics slightly, and a changed
answer changes its conversation's next prompts). Progress goes to stderr, the host and
the table to stdout, everything to `--json` (default bench/results/prefix_reuse.json;
none with --quick).

Run it as root inside a loopback-only network namespace, as `make test` does:
`unshare -n -- sh -c 'ip link set lo up && OMP_NUM_THREADS=1 .venv/bin/python -m bench.prefix_reuse'`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import yaml

from bench import host_steal
from bench.harness.conversations import Conversation, Shape, Turn, chat_turn, client, conversations, run_rounds
from bench.harness.deploy_procs import answers, serving, wait_for
from bench.harness.worker_procs import REPO, free_port
from bench.host_cpu import host_cpu
from bench.serving_metrics import distribution

RESULTS = REPO / "bench" / "results" / "prefix_reuse.json"


@dataclass(frozen=True)
class Config:
    name: str
    prefix_routing: bool
    disk: bool
    what: str


CONFIGS = {c.name: c for c in (
    Config("before", False, False, "--no-prefix-routing, no disk tier: least outstanding tokens, no fetch"),
    Config("index", True, False, "prefix routing and the sibling fetch, no disk tier"),
    Config("after", True, True, "prefix routing, the sibling fetch and --kv-disk-dir"),
)}

FULL = Shape(conversations=16, turns=8, system_prompts=3, system_words=480, user_words=60, max_tokens=24,
             concurrency=4)
QUICK = Shape(conversations=2, turns=2, system_prompts=1, system_words=96, user_words=16, max_tokens=8,
              concurrency=2, pause_s=2.5)
FULL_KV_BLOCKS = 256  # per worker (16 tokens each): far below the full workload's distinct prefixes
QUICK_KV_BLOCKS = 256


def _say(message: str) -> None:
    print(f"[prefix_reuse {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def host() -> dict:
    """This host's CPU as lscpu names it, and its cores."""
    cpu = host_cpu()
    return {"cpu": cpu.name, "family": cpu.family, "model": cpu.model, "cores": os.cpu_count() or 0}


# ---- /metrics ----------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """The deployment's /metrics (the gateway's, each worker's series labelled by worker and role)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=60).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_label(samples: Samples, name: str, *keys: str) -> dict[str, float]:
    """`name`'s series summed by the values of the labels `keys` ("a/b"; "" with no keys)."""
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name:
            key = "/".join(dict(ls).get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + v
    return out


def metrics_delta(start: Samples, end: Samples) -> dict:
    """What the workload did to the deployment's counters (end less start); the disk tier's
    size at the end."""
    def delta(name: str, *keys: str) -> dict[str, int]:
        a, b = by_label(start, name, *keys), by_label(end, name, *keys)
        return {k: round(b[k] - a.get(k, 0.0)) for k in sorted(b) if round(b[k] - a.get(k, 0.0))}

    prompt = delta("pdserve_engine_prompt_tokens_total", "role")
    hits = delta("pdserve_engine_prefix_cache_hit_tokens_total", "role")
    by_role: dict[str, dict[str, int]] = {}
    for key, n in delta("pdserve_prefix_fetches_total", "role", "outcome").items():
        role, outcome = key.split("/")
        by_role.setdefault(role, {})[outcome] = n
    disk = {name: sum(delta(f"pdserve_engine_kv_disk_{name}_total").values())
            for name in ("blocks_written", "blocks_loaded", "corrupt_blocks", "dropped_saves", "failed_writes")}
    disk.update({name: round(sum(by_label(end, f"pdserve_engine_kv_disk_{name}").values()))
                 for name in ("entries", "bytes", "max_bytes")})
    return {"prompt_tokens": prompt, "prefix_hit_tokens": hits,
            "computed_tokens": {role: prompt[role] - hits.get(role, 0) for role in prompt},
            "tier_tokens": delta("pdserve_engine_prefix_tier_tokens_total", "tier"),
            # a decode worker's fetches from its prefix source; a prefill worker's from the asking decode worker
            "fetches": by_role.get("decode", {}), "prefill_fetches": by_role.get("prefill", {}),
            "served_blocks": sum(delta("pdserve_prefix_served_blocks_total").values()),
            "routes": delta("pdserve_prefix_routes_total", "pool", "by"),
            "matched_blocks": delta("pdserve_prefix_matched_blocks_total", "pool"),
            "prefix_sources": sum(delta("pdserve_prefix_sources_total").values()),
            "preemptions": sum(delta("pdserve_engine_preemptions_total").values()),
            "disk": disk}


# ---- one configuration -------------------------------------------------------------------------

def _deploy_config(path: Path, prefill: int, kv_blocks: int) -> None:
    pool = {"kv_blocks": kv_blocks, "threads": 1}
    path.write_text(yaml.safe_dump({
        "model": "smollm2", "prefill": {"replicas": prefill, **pool}, "decode": {"replicas": 2, **pool},
        # never shed: every turn is measured; the index's Stats rounds every 2 s
        "gateway": {"max_ttft_s": None}, "health_interval_s": 2.0}))


async def _warm_up(url: str, model: str) -> None:
    """Two short turns at once (one on each decode worker: the second finds the first's
    worker busier), unrecorded: each worker's first-request costs, off the figures."""
    convs = [Conversation(i, "You are a warm-up.", [f"Say {word}."]) for i, word in enumerate(("yes", "no"))]
    async with client() as http:
        done = await asyncio.gather(*(chat_turn(http, url, model, c, 0, 4) for c in convs))
    failed = [t.error for t in done if not t.ok]
    if failed:
        raise RuntimeError(f"the warm-up failed: {failed[0]}")


def run_config(config: Config, shape: Shape, seed: int, prefill: int, kv_blocks: int, workdir: Path) -> dict:
    folder = workdir / config.name
    folder.mkdir(parents=True)
    _deploy_config(folder / "deploy.yaml", prefill, kv_blocks)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--config", str(folder / "deploy.yaml"), "--port", str(port)]
    if not config.prefix_routing:
        flags.append("--no-prefix-routing")
    if config.disk:
        flags += ["--kv-disk-dir", str(folder / "kv-disk")]
    _say(f"{config.name}: starting pdserve serve {' '.join(flags[2:])} ({prefill} prefill + 2 decode, "
         f"{kv_blocks} KV blocks each; logs under {folder})")
    t_start = time.monotonic()
    # the flags as given, less this run's temporary folder
    result: dict = {"config": config.name, "what": config.what,
                    "flags": [f.replace(str(workdir), "$TMP") for f in flags[4:]]}
    try:
        with serving(folder / "serve.log", *flags, env={"PDSERVE_LOG_DIR": str(folder / "logs")}):
            wait_for(lambda: answers(url), 120, "the gateway ready", folder / "serve.log")
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            result["start_s"] = round(time.monotonic() - t_start, 1)
            asyncio.run(_warm_up(url, model))
            time.sleep(2.5)  # a Stats round: the warm-up's blocks in the index, its counters settled
            before = scrape(url)
            ticks, result["load_before"] = host_steal.read(), round(os.getloadavg()[0], 2)
            _say(f"{config.name}: serving after {result['start_s']}s; {shape.conversations} conversations x "
                 f"{shape.turns} turns, {shape.concurrency} in flight")
            t0 = time.perf_counter()
            turns = asyncio.run(run_rounds(url, model, conversations(shape, seed), shape, seed, _say))
            result["wall_s"] = round(time.perf_counter() - t0, 2)
            result["host_steal"] = host_steal.fraction(ticks, host_steal.read())
            result["load_after"] = round(os.getloadavg()[0], 2)  # the 1-minute load average, the run's own included
            time.sleep(2.5)  # the last turns' counters reach the workers' registries
            result["metrics"] = metrics_delta(before, scrape(url))
    except (AssertionError, RuntimeError, httpx.HTTPError) as e:  # it did not start, serve or stop cleanly
        result["error"] = str(e)[-3000:]
        _say(f"{config.name}: {result['error']}")
        if "wall_s" not in result:
            return result
    result.update(summarize(turns))
    _say(f"{config.name}: done in {result['wall_s']}s: TTFT p50 {_ms(result['ttft_s']['p50'])} ms, "
         f"p90 {_ms(result['ttft_s']['p90'])} ms, {result['computed_answers']} of {result['prompt_tokens']} "
         f"prompt tokens computed, {result['failed']} failed")
    return result


def summarize(turns: list[Turn]) -> dict:
    """The client's view of the answered turns: TTFT, tokens sent and cached, and how many ran
    on another decode worker than their conversation's previous answered turn."""
    ok = [t for t in turns if t.ok]
    last: dict[int, str] = {}
    moved = 0
    for t in sorted(ok, key=lambda t: (t.turn, t.conversation)):
        moved += t.conversation in last and t.decode_worker != last[t.conversation]
        last[t.conversation] = t.decode_worker
    sent = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    return {"turns": [asdict(t) for t in turns], "failed": len(turns) - len(ok),
            "ttft_s": distribution([t.ttft_s for t in ok]), "e2e_s": distribution([t.e2e_s for t in ok]),
            "prompt_tokens": sent, "cached_answers": cached, "computed_answers": sent - cached,
            "headers_agree": all(t.header_cached_tokens == t.cached_tokens for t in ok), "moved_turns": moved,
            "sibling_blocks": sum(t.prefix_blocks for t in ok)}


# ---- the comparison -----------------------------------------------------------------------------

def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def _ratio(after: float | None, before: float | None) -> float | None:
    return None if after is None or not before else round(after / before, 3)


def identical(a: dict, b: dict) -> float | None:
    """The share of turns whose answers are the same text in both runs."""
    texts = {(t["conversation"], t["turn"]): t["text"] for t in a.get("turns", []) if not t["error"]}
    pairs = [(texts[(t["conversation"], t["turn"])], t["text"]) for t in b.get("turns", [])
             if not t["error"] and (t["conversation"], t["turn"]) in texts]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


def identical_pairs(results: list[dict]) -> dict[str, float | None]:
    """`identical` for every pair of configurations, the earlier first."""
    return {f"{b['config']} vs {a['config']}": identical(a, b)
            for i, a in enumerate(results) for b in results[i + 1:]}


def rows(result: dict) -> dict[str, float | None]:
    """The table's figures of one configuration (None: not measured)."""
    m, ttft = result.get("metrics"), result.get("ttft_s") or {}
    ms = {f"TTFT {q} ms": None if ttft.get(q) is None else ttft[q] * 1e3 for q in ("p50", "p90")}
    client = {"wall s": result.get("wall_s"), "prompt tokens sent": result.get("prompt_tokens"),
              "computed (answers)": result.get("computed_answers")}
    if not m:
        return {**ms, **client, "turns moved worker": result.get("moved_turns"), "failed turns": result.get("failed")}
    fetches = m["fetches"]
    served = {"computed (/metrics)": m["computed_tokens"].get("decode", 0)}
    if "prefill" in m["prompt_tokens"]:
        served["  by prefill workers"] = m["computed_tokens"].get("prefill", 0)
    return {**ms, **client, **served,
            "hit tokens (all tiers)": m["prefix_hit_tokens"].get("decode", 0),
            "  from a sibling": m["tier_tokens"].get("sibling", 0), "  from disk": m["tier_tokens"].get("disk", 0),
            "fetches done (partial)": fetches.get("fetched", 0) + fetches.get("partial", 0),
            "fetches failed": fetches.get("failed", 0), "fetches found evicted": fetches.get("evicted", 0),
            "fetches skipped (cost)": fetches.get("skipped_cost", 0),
            "fetches skipped (room)": fetches.get("skipped_room", 0),
            "disk blocks written": m["disk"]["blocks_written"], "turns moved worker": result.get("moved_turns"),
            "preemptions": m["preemptions"], "failed turns": result.get("failed")}


def table(results: list[dict]) -> str:
    """Every configuration side by side, and each one's ratio to the first."""
    names = [r["config"] for r in results]
    figures = [rows(r) for r in results]
    keys = list(dict.fromkeys(k for f in figures for k in f))
    lines = [f"{'':<26}" + "".join(f"{n:>12}" for n in names)
             + "".join(f"{n + '/' + names[0]:>16}" for n in names[1:])]
    for key in keys:
        cells = [f.get(key) for f in figures]
        shown = "".join(f"{'-' if c is None else f'{c:.1f}' if key == 'wall s' else f'{c:.0f}':>12}" for c in cells)
        ratios = "".join(f"{'-' if (x := _ratio(c, cells[0])) is None else f'{x:.2f}x':>16}" for c in cells[1:])
        lines.append(f"{key:<26}{shown}{ratios}")
    for pair, same in identical_pairs(results).items():
        lines.append(f"answers identical, {pair}: {'-' if same is None else f'{same:.0%}'}")
    for r in results:
        m = r.get("metrics")
        if m:
            lines.append(f"{r['config']}: routes {m['routes'] or '-'}, fetches {m['fetches'] or '-'}, "
                         f"prefix sources {m['prefix_sources']}, disk {m['disk']}; x-pdserve-cached-tokens "
                         f"{'equal' if r['headers_agree'] else 'NOT equal'} to usage's cached_tokens, "
                         f"x-pdserve-prefix-blocks {r['sibling_blocks']} blocks from a sibling")
        if r.get("error"):
            lines.append(f"{r['config']}: ERROR {r['error'][:300]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_reuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="before,index,after", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="a tiny workload (2 conversations of 2 turns), for the test")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--system-prompts", type=int)
    ap.add_argument("--system-words", type=int, help="tokens in each system prompt")
    ap.add_argument("--user-words", type=int, help="tokens in each user message")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--concurrency", type=int, help="turns in flight at once")
    ap.add_argument("--pause-s", type=float, help="seconds between rounds")
    ap.add_argument("--kv-blocks", type=int, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--prefill", type=int, default=0, help="prefill workers (0: aggregated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help=f"default {RESULTS.relative_to(REPO)} (none with --quick)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the deployments' logs and disk tiers")
    args = ap.parse_args()
    configs = args.configs.split(",")
    if set(configs) - set(CONFIGS):
        ap.error(f"--configs: unknown {sorted(set(configs) - set(CONFIGS))}")
    base = QUICK if args.quick else FULL
    shape = Shape(**{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in asdict(base).items()})
    kv_blocks = args.kv_blocks or (QUICK_KV_BLOCKS if args.quick else FULL_KV_BLOCKS)
    out = args.json or (None if args.quick else RESULTS)
    h = host()
    print(f"host: {h['cpu']} (family {h['family']} model {h['model']}), {h['cores']} cores", flush=True)
    _say(f"workload {asdict(shape)}, seed {args.seed}, {kv_blocks} KV blocks a worker, configs {configs}")
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-prefix-reuse-"))
    results = [run_config(CONFIGS[name], shape, args.seed, args.prefill, kv_blocks, workdir) for name in configs]
    print(table(results), flush=True)
    # a failure anywhere (a deployment's, a turn's, a fetch's, a corrupt disk block) keeps the logs to read
    failed = any(r.get("error") or r.get("failed") or r.get("metrics", {}).get("fetches", {}).get("failed")
                 or r.get("metrics", {}).get("disk", {}).get("corrupt_blocks") for r in results)
    if failed or args.keep_logs:
        _say(f"logs kept under {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if out:
        out.write_text(json.dumps({"host": h, "shape": asdict(shape), "seed": args.seed, "kv_blocks": kv_blocks,
                                   "prefill": args.prefill, "configs": results,
                                   "ratios": {r["config"]: {k: _ratio(v, rows(results[0]).get(k))
                                                            for k, v in rows(r).items()} for r in results[1:]},
                                   "identical_answers": identical_pairs(results)}, indent=1))
        _say(f"wrote {out}")


if __name__ == "__main__":
    main()
