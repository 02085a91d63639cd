"""How long a decode worker takes to leave under load, with and without hand-off, in one run.

    python -m bench.scale_in [--streams 16] [--tokens 768] [--modes off,replay,kv,cold] [--move-only]
                             [--json out.json]

For each way a drained decode worker can treat its requests (`off`: `drain_hand_off:
false`, it finishes them first; `replay`: it hands them off without their KV, decode
workers run with `--no-kv-hand-off`, and the other decode worker prefills each from the
tokens it streamed; `kv`: the default, it hands them off and keeps their KV, which the
other decode worker copies over NIXL; `cold`: as `kv`, but a planner move starts a new
worker cold instead of changing the drained one's role in place, `move_in_place: false`),
on a fresh `pdserve serve` (1 prefill + 2 decode workers, SmolLM2):

- scale-in: `--streams` long greedy generations of `--tokens` tokens (768) spread over both
  decode workers; once each has its first token, `pdserve scale --decode 1`. Measured:
  the scale call's wall time, the drain's own length (the controller's log), the streams
  that completed or failed, when the last ended, and the longest pause any stream saw
  between two chunks (a moved stream's stall: its taker's prefill, or its KV copy).
- planner move: back to 2 decode workers (the cold start is timed too), the same streams,
  then `pdserve scale --prefill 2 --decode 1`, the move the online planner makes: a decode
  worker's drain and its role changed in place (weights kept), or with `cold` a new
  prefill worker's cold start plus the drain. Measured as well: from the decision to the
  new prefill worker serving (the controller's log).

Run it as root inside a loopback-only network namespace, as `make test` does:
`unshare -n -- sh -c 'ip link set lo up && OMP_NUM_THREADS=1 .venv/bin/python -m bench.scale_in'`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.chaos.client import client, completion, send
from bench.chaos.deployment import BIN, REPO, Deployment
from bench.chaos.report import Outcome
from bench.chaos.sizes import QUICK
from kernels.host import cpu


DECODE_KV_BLOCKS = 1280  # 20k tokens: 16 streams of 32 + 768 tokens fit on one decode worker


class ScaleDeployment(Deployment):
    """The chaos deployment with the drain's hand-off set, and room for a second prefill worker."""

    def __init__(self, workdir: Path, mode: str, max_output_tokens: int):
        super().__init__(workdir, QUICK, None, prefill_replicas=1)
        self.mode, self.max_output_tokens = mode, max_output_tokens

    def config(self, token: str) -> dict:
        config = super().config(token)
        config["gateway"]["max_output_tokens"] = self.max_output_tokens
        # Room on one decode worker for every stream at its longest: what a stream's pauses
        # measure is then the move, not preemptions of a worker too small to take them all.
        config["decode"]["kv_blocks"] = max(config["decode"]["kv_blocks"], DECODE_KV_BLOCKS)
        if self.mode == "replay":
            config["decode"]["extra_args"].append("--no-kv-hand-off")
        return {**config, "drain_hand_off": self.mode != "off", "move_in_place": self.mode != "cold",
                "health_interval_s": 2.0}


def _scale(dep: Deployment, *args: str) -> float:
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / "pdserve"), "scale", *args, "--address", dep.address], cwd=REPO, env=dep.env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve scale {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return time.monotonic() - t0


async def _under_streams(dep: Deployment, streams: int, tokens: int, rng: random.Random, *scale: str) -> dict:
    """`streams` generations, then `pdserve scale SCALE` once each has its first token."""
    started, every = [0], asyncio.Event()

    def on_text() -> None:
        started[0] += 1
        if started[0] >= streams:
            every.set()

    async with client() as http:
        tasks = [asyncio.create_task(send(http, dep.url, completion(32, tokens, rng), on_text=on_text))
                 for _ in range(streams)]
        await asyncio.wait_for(every.wait(), 300)
        offset = len(dep.log_text())
        t0 = time.monotonic()
        scale_s = await asyncio.to_thread(_scale, dep, *scale)
        records = await asyncio.gather(*tasks)
        finished_s = time.monotonic() - t0
    log = dep.log_text()[offset:]
    drained = re.findall(r"decode worker \d+: removed \((\w+) after ([\d.]+)s of draining\)", log)
    drained += [("empty", s) for s in re.findall(r"decode worker \d+: drained in ([\d.]+)s, is prefill", log)]
    return {"scale_s": round(scale_s, 2), "serving_s": _new_worker_serving_s(log),
            "drain_s": float(drained[-1][1]) if drained else None,
            "drain_end": drained[-1][0] if drained else None, "streams_done_s": round(finished_s, 2),
            "completed": sum(r.outcome is Outcome.COMPLETED for r in records),
            "failed": sum(r.outcome is not Outcome.COMPLETED for r in records),
            "max_gap_s": round(max(r.max_gap_s for r in records), 2)}


def _new_worker_serving_s(log: str) -> float | None:
    """From a move's decision to its new worker serving, by the controller's log: a new
    worker's cold start (`new workers ready after`), or the drain plus the role change in
    place (the whole scale: it ends when the moved worker serves)."""
    scale = re.search(r"scale \((?:move|out|in): .*?\) done in ([\d.]+)s: new workers ready after ([\d.]+)s", log)
    if scale is None:
        return None
    return float(scale.group(1)) if "role changed in place" in log else float(scale.group(2))


def run(mode: str, streams: int, tokens: int, seed: int, move_only: bool = False) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-scale-in-") as tmp:
        dep = ScaleDeployment(Path(tmp), mode, tokens)
        print(f"hand-off {mode}: starting pdserve serve (1 prefill + 2 decode)", flush=True)
        dep.start()
        try:
            scale_in, cold_s = None, float("nan")
            if not move_only:
                scale_in = asyncio.run(_under_streams(dep, streams, tokens, rng, "--decode", "1"))
                print(f"  scale-in: {scale_in}", flush=True)
                cold_s = _scale(dep, "--decode", "2")
                print(f"  back to 2 decode workers (a cold start): {cold_s:.1f}s", flush=True)
            move = asyncio.run(_under_streams(dep, streams, tokens, rng, "--prefill", "2", "--decode", "1"))
            print(f"  planner move (+1 prefill, -1 decode): {move}", flush=True)
        finally:
            code, left = dep.stop()
        if code != 0 or left:
            print(f"  pdserve serve stopped with {code}, left {left}")
    return {"mode": mode, "scale_in": scale_in, "cold_start_s": round(cold_s, 2), "move": move}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_in", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=768,
                    help="output tokens per stream: long enough to outlast a new worker's cold start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="off,replay,kv,cold", help="comma-separated: off, replay, kv, cold")
    ap.add_argument("--move-only", action="store_true", help="only the planner move (no scale-in first)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(f"host: {cpu().describe()}; {args.streams} streams of {args.tokens} tokens", flush=True)
    modes = args.modes.split(",")
    known = {"off", "replay", "kv", "cold"}
    if set(modes) - known:
        ap.error(f"--modes: unknown {sorted(set(modes) - known)}")
    results = [run(mode, args.streams, args.tokens, args.seed, args.move_only) for mode in modes]
    print(f"\n{'mode':<8}{'scale-in s':>11}{'drain s':>9}{'failed':>8}{'ends s':>8}{'max gap s':>10}"
          f"{'move s':>9}{'serving s':>10}{'drain s':>9}{'failed':>8}{'max gap s':>10}{'cold start s':>14}")

    def seconds(x: float | None) -> float:
        return float("nan") if x is None else x

    for r in results:
        a, m = r["scale_in"] or {"scale_s": None, "drain_s": None, "failed": "-", "streams_done_s": None,
                                 "max_gap_s": None}, r["move"]
        print(f"{r['mode']:<8}{seconds(a['scale_s']):>11.1f}{seconds(a['drain_s']):>9.1f}{a['failed']:>8}"
              f"{seconds(a['streams_done_s']):>8.1f}{seconds(a['max_gap_s']):>10.2f}{m['scale_s']:>9.1f}"
              f"{seconds(m['serving_s']):>10.1f}{seconds(m['drain_s']):>9.1f}{m['failed']:>8}{m['max_gap_s']:>10.2f}"
              f"{r['cold_start_s']:>14.1f}")
    if args.json:
        args.json.write_text(json.dumps({"host": cpu().describe(), "streams": args.streams, "tokens": args.tokens,
                                         "runs": results}, indent=1))


if __name__ == "__main__":
    main()
