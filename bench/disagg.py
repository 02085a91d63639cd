"""Disaggregated vs aggregated serving on this machine: TTFT and decode ITL.

    python -m bench.disagg [--model smollm2] [--dtype auto] [--json out.json]

Every worker is a process pinned to its own core (1 torch thread).
1. TTFT of one request, remote prefill (prefill worker on core 0 -> NIXL -> decode worker
   on core 1) vs local prefill on the same decode worker, for 512- and 2048-token prompts;
   the transfer's share of the remote TTFT comes from the prefill worker's timings.
2. Decode ITL while long prompts keep arriving, on the same two cores: disaggregated
   (1 prefill + 1 decode worker) vs aggregated (2 workers that each prefill and decode,
   requests split between them). Decode streams: short prompts, long outputs; long
   prompts (2048 tokens, 1 output token) arrive at a fixed interval meanwhile.
Prompts are random token ids, fresh per request, so no prefix cache helps either side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import grpc

from bench.harness.worker_procs import WorkerProc, WorkerSpec, start_workers
from common.model_source import resolve_model
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc


READY_TIMEOUT_S = 240.0  # each worker loads the model on its one core


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class StreamResult:
    ttft: float
    token_times: list[float] = field(default_factory=list)  # arrival time of each message's tokens
    transfer_s: float = 0.0
    tokens: int = 0


class Client:
    def __init__(self, vocab_lo: int = 100, vocab_hi: int = 40000, seed: int = 0):
        self.rng = random.Random(seed)
        self.lo, self.hi = vocab_lo, vocab_hi
        self.lock = threading.Lock()
        self.n = 0

    def prompt(self, n: int) -> list[int]:
        with self.lock:
            return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def rid(self) -> str:
        with self.lock:
            self.n += 1
            return f"bench-{self.n}"

    def generate(self, decode: str, prompt: list[int], max_tokens: int, prefill: list[str]) -> StreamResult:
        stub = pb_grpc.DecodeWorkerStub(grpc.insecure_channel(decode))
        req = pb.GenerateRequest(request_id=self.rid(), prompt_token_ids=prompt, prefill_workers=prefill,
                                 params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        res = StreamResult(ttft=0.0)
        for msg in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if msg.token_ids:
                if not res.token_times:
                    res.ttft = now - t0
                res.token_times.append(now)
                res.tokens += len(msg.token_ids)
            if msg.finish_reason != pb.FINISH_NONE:
                res.transfer_s = msg.timings.transfer_s
        return res


def ttft_table(client: Client, decode: WorkerProc, prefill: WorkerProc, lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    client.generate(decode.address, client.prompt(64), 1, [prefill.address])  # warm-up: connection set-up
    client.generate(decode.address, client.prompt(64), 1, [])
    for n in lengths:
        for mode, workers in (("local", []), ("remote", [prefill.address])):
            results = [client.generate(decode.address, client.prompt(n), 1, workers) for _ in range(repeats)]
            ttft = statistics.median(r.ttft for r in results)
            transfer = statistics.median(r.transfer_s for r in results)
            rows.append({"prompt": n, "mode": mode, "ttft_ms": ttft * 1e3, "transfer_ms": transfer * 1e3,
                         "transfer_share": transfer / ttft if mode == "remote" else 0.0})
            log(f"TTFT {mode} {n} tokens: {ttft * 1e3:.0f} ms")
    return rows


def itl_run(client: Client, decodes: list[str], prefill: list[str], streams: int, out_tokens: int,
            long_prompt: int, interval_s: float) -> dict:
    results: list[StreamResult] = []
    longs: list[StreamResult] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        r = client.generate(decodes[i % len(decodes)], client.prompt(64), out_tokens, [])
        with lock:
            results.append(r)

    def long_request(i: int) -> None:
        r = client.generate(decodes[i % len(decodes)], client.prompt(long_prompt), 1, prefill)
        with lock:
            longs.append(r)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    arrivals, i = [], 0
    while any(t.is_alive() for t in threads):
        t = threading.Thread(target=long_request, args=(i,))
        t.start()
        arrivals.append(t)
        i += 1
        time.sleep(interval_s)
    for t in threads + arrivals:
        t.join()
    elapsed = time.perf_counter() - t0
    gaps = sorted(b - a for r in results for a, b in zip(r.token_times, r.token_times[1:]))
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": q[49] * 1e3, "itl_p99_ms": q[98] * 1e3, "decode_tok_s": sum(r.tokens for r in results) / elapsed,
            "long_prompts": len(longs), "long_ttft_p50_ms": statistics.median(r.ttft for r in longs) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    client = Client()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
    model = resolve_model(args.model)  # converted once here, not by both workers at once
    dtype = ["--dtype", args.dtype]
    procs: list[WorkerProc] = []
    report: dict = {"model": args.model, "dtype": args.dtype}
    try:
        log("starting prefill (core 0) and decode (core 1) workers")
        procs = start_workers([WorkerSpec("prefill", dtype, core=0), WorkerSpec("decode", dtype, core=1)],
                              model, tmp, READY_TIMEOUT_S)
        p, d = procs
        report["ttft"] = ttft_table(client, d, p, [int(x) for x in args.lengths.split(",")], args.repeats)
        log("ITL under long-prompt arrivals: disaggregated")
        report["disaggregated"] = itl_run(client, [d.address], [p.address], args.streams, args.out_tokens,
                                          args.long_prompt, args.interval)
        for w in procs:
            w.stop()
        log("ITL under long-prompt arrivals: aggregated (two workers, one core each)")
        procs = start_workers([WorkerSpec("decode", [*dtype, "--no-transfer"], core=core) for core in (0, 1)],
                              model, tmp, READY_TIMEOUT_S)
        report["aggregated"] = itl_run(client, [w.address for w in procs], [], args.streams, args.out_tokens,
                                       args.long_prompt, args.interval)
    finally:
        for w in procs:
            w.stop()
    print(f"pdserve disaggregated vs aggregated: {args.model} {args.dtype}, one core per worker, 2 cores in all\n")
    print(f"{'prompt':>7} {'mode':>7} {'TTFT ms':>9} {'transfer ms':>12} {'transfer share':>15}")
    for r in report["ttft"]:
        share = f"{r['transfer_share'] * 100:.1f}%" if r["mode"] == "remote" else "-"
        print(f"{r['prompt']:>7} {r['mode']:>7} {r['ttft_ms']:>9.0f} {r['transfer_ms']:>12.1f} {share:>15}")
    print(f"\n{args.streams} decode streams (64-token prompts, {args.out_tokens} tokens each) while "
          f"{args.long_prompt}-token prompts arrive every {args.interval:.1f} s")
    print(f"{'':16} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'decode tok/s':>13} {'long TTFT p50 ms':>17}")
    for mode in ("disaggregated", "aggregated"):
        r = report[mode]
        print(f"{mode:16} {r['itl_p50_ms']:>11.1f} {r['itl_p99_ms']:>11.1f} {r['decode_tok_s']:>13.1f} "
              f"{r['long_ttft_p50_ms']:>17.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
