"""Online serving benchmark: latency, SLO attainment and goodput of an OpenAI-compatible server.

    pdserve bench --url http://127.0.0.1:8000 --model smollm2 --workload sharegpt \\
        --sweep 0.5,1,2 --num-requests 100 --slo-ttft 1.0 --slo-tpot 0.2 --json out.json --plot out
    python -m bench.serving_cli ...   (the same; bench/serving_cli.py is the command)
    pdserve bench --compare --cores 2 ...   (aggregated vs disaggregated, see bench/compare.py)

Every request is a streamed POST /v1/completions whose prompt is a list of token ids (so
its length is exact; corpus slices from deploy/planner/workload.py, tokenized with the served
model's tokenizer, or --tokenizer FOLDER for a model pdserve cannot resolve, e.g. one
served by vLLM), with max_tokens = the drawn output length, ignore_eos, temperature 0 and
usage in the stream. The client stamps every SSE chunk that carries text:

- TTFT: send -> first text chunk; ITL: the gaps between consecutive text chunks (a chunk
  holding several tokens is one gap); e2e: send -> [DONE];
  TPOT = (e2e - TTFT) / (output tokens - 1), output tokens from the usage chunk.
- A non-200 answer, an SSE error event, a stream that ends before [DONE] or a transport
  error fails the request; 429 is counted apart, as rejected (the server shed it).
- A request is good if it finished and met every SLO (TTFT <= --slo-ttft, TPOT <=
  --slo-tpot); SLO attainment = good / all requests sent, failed and rejected included.
  Goodput = the highest swept rate with >= 90% attainment (`--goodput-search` bisects
  between that and the next failing rate); for concurrency runs it is the request
  throughput of the highest passing concurrency.

Load is open-loop Poisson arrivals at --rate/--sweep req/s (requests are sent on schedule
whether or not earlier ones finished), or closed-loop with --concurrency streams, each
sending its next request when the last one ends. Every run of a sweep draws the same
lengths (--seed) but fresh prompts: each prompt starts with a random token, so a run gets
no prefix-cache hits from earlier runs. A run ends when all its requests have finished.
Progress goes to stderr, the table to stdout.

On a machine with other interfaces, run a local server and the benchmark inside a
loopback-only network namespace (as root), or embedded Ray binds to eth0:
    unshare -n -- sh -c 'ip link set lo up && pdserve bench --compare --cores 2 ...'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass

from bench import host_steal

# percentile, distribution and QUANTILES too: other modules import them from here
from bench.serving_metrics import (  # noqa: F401
    GOOD_ATTAINMENT,
    QUANTILES,
    SLO,
    Load,
    RequestRecord,
    Run,
    Status,
    distribution,
    goodput,
    next_probe,
    percentile,
    summarize,
)
from deploy.planner.workload import Request, poisson_arrivals, requests_from_lengths, sample_workload
from gateway.front_door.head_deadline import CLIENT_KEEPALIVE_EXPIRY_S as KEEPALIVE_EXPIRY_S

CLOSED_LOOP_POOL = 20  # requests drawn per stream per second of --duration in closed loop


# ---- the client -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """The server under test and how to ask it."""

    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def body(self, req: Request) -> dict:
        return {"model": self.model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}

    async def send(self, client, req: Request, rec: RequestRecord) -> None:
        """Stream one completion into `rec` (status, timings, output tokens)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        t0 = last = time.perf_counter()
        chunks, done = 0, False
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=self.body(req),
                                     headers=headers) as resp:
                if resp.status_code != 200:
                    rec.status = Status.REJECTED if resp.status_code == 429 else Status.FAILED
                    rec.error = f"HTTP {resp.status_code}: {_message((await resp.aread()).decode(errors='replace'))}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = f"stream error: {_message(data)}"
                        return
                    choices = event.get("choices") or []
                    if choices and choices[0].get("text"):
                        now = time.perf_counter()
                        if chunks == 0:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last, chunks = now, chunks + 1
                    if event.get("usage"):
                        rec.output_tokens = int(event["usage"].get("completion_tokens", 0))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:  # transport or a malformed answer
            rec.error = f"{type(e).__name__}: {e}"
            return
        if not done or chunks == 0:
            rec.error = "stream ended before [DONE]" if not done else "no text was streamed"
            return
        rec.e2e_s = time.perf_counter() - t0
        rec.output_tokens = rec.output_tokens or chunks  # a server that sends no usage
        if rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
        rec.status = Status.OK


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


def _client(target: Target):
    try:
        import httpx
    except ImportError:
        raise SystemExit("pdserve bench needs httpx: pip install httpx (or pip install -e '.[dev]')") from None
    return httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S))


async def _run_load(target: Target, load: Load, requests: list[Request], arrivals: list[float] | None,
                    duration_s: float | None, progress) -> tuple[list[RequestRecord], float, float]:
    """Send `requests` open-loop at `arrivals` or closed-loop; all records once all finished,
    the run's duration, and its start on the wall clock (arrivals count from it)."""
    records: list[RequestRecord] = []
    async with _client(target) as client:
        t0, started_at = time.perf_counter(), time.time()

        async def one(req: Request) -> None:
            rec = RequestRecord(len(req.prompt_token_ids), arrival_s=time.perf_counter() - t0)
            records.append(rec)
            await target.send(client, req, rec)
            progress.update(1)

        if arrivals is not None:
            async def scheduled(req: Request, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                await one(req)

            await asyncio.gather(*(scheduled(r, a) for r, a in zip(requests, arrivals)))
        else:
            pending = iter(requests)

            async def stream() -> None:
                for req in pending:  # one iterator shared by every stream
                    if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                        return
                    await one(req)

            await asyncio.gather(*(stream() for _ in range(load.concurrency)))
        return sorted(records, key=lambda r: r.arrival_s), time.perf_counter() - t0, started_at


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- runs and sweeps ------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What every run of a sweep sends: the workload, its size and the SLOs."""

    workload: str
    params: dict
    num_requests: int | None
    duration_s: float | None
    slo: SLO
    seed: int = 0
    pause_s: float = 2.0

    def size(self, load: Load) -> int:
        if self.num_requests is not None:
            return self.num_requests
        if load.rate is not None:  # enough arrivals to cover the duration, cut at it below
            return math.ceil(load.rate * self.duration_s * 1.5) + 16
        return math.ceil(CLOSED_LOOP_POOL * load.concurrency * self.duration_s)


def run_one(target: Target, plan: Plan, load: Load, tokenizer, index: int) -> Run:
    from tqdm import tqdm

    n = plan.size(load)
    lengths = sample_workload(plan.workload, n, plan.seed, **plan.params)
    # Same lengths every run, fresh prompts: another slice seed and a random first token.
    requests = requests_from_lengths(tokenizer, lengths, seed=plan.seed * 1000 + index + 1,
                                     vocab_size=getattr(tokenizer, "vocab_size", None))
    arrivals = None
    if load.rate is not None:
        arrivals = poisson_arrivals(load.rate, n, plan.seed + 1)
        if plan.num_requests is None:
            arrivals = [a for a in arrivals if a < plan.duration_s]
            requests = requests[:len(arrivals)]
    total = len(requests) if arrivals is not None or plan.num_requests is not None else None
    label = f"rate {load.rate:g}/s" if load.rate is not None else f"concurrency {load.concurrency}"
    ticks = host_steal.read()
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        records, duration, started_at = asyncio.run(_run_load(target, load, requests, arrivals, plan.duration_s, bar))
    summary = summarize(records, duration, plan.slo)
    summary["host_steal"] = host_steal.fraction(ticks, host_steal.read())  # CPU the VM's host took meanwhile
    return Run(load, duration, summary, records, started_at)


def sweep(target: Target, plan: Plan, loads: list[Load], tokenizer, search_steps: int = 0) -> list[Run]:
    """Each load in turn (a pause between), then up to `search_steps` bisection rates."""
    runs: list[Run] = []
    for load in loads:
        if runs:
            time.sleep(plan.pause_s)
        runs.append(run_one(target, plan, load, tokenizer, len(runs)))
        _say(f"{load.key} {load.x:g}: attainment {runs[-1].summary['slo_attainment']:.0%}{_steal(runs[-1])}")
    for _ in range(search_steps):
        rate = next_probe(runs)
        if rate is None:
            break
        time.sleep(plan.pause_s)
        runs.append(run_one(target, plan, Load(rate=round(rate, 4)), tokenizer, len(runs)))
        _say(f"goodput search, rate {rate:.4g}: attainment {runs[-1].summary['slo_attainment']:.0%}"
             f"{_steal(runs[-1])}")
    return sorted(runs, key=lambda r: r.load.x)


def _steal(run: Run) -> str:
    steal = run.summary.get("host_steal")
    return "" if steal is None else f" (the VM's host took {steal:.1%} of the CPU meanwhile)"


def warm_up(target: Target, tokenizer) -> None:
    """One short request, unrecorded: the connection, the server's first-request costs, and
    an early, clear error if the server or the model name is wrong."""
    req = requests_from_lengths(tokenizer, [(16, 4)], seed=-1, vocab_size=getattr(tokenizer, "vocab_size", None))[0]

    async def go() -> RequestRecord:
        rec = RequestRecord(16)
        async with _client(target) as client:
            await target.send(client, req, rec)
        return rec

    rec = asyncio.run(go())
    if rec.status is not Status.OK:
        raise SystemExit(f"pdserve bench: the warm-up request to {target.url} failed: {rec.error}")


# ---- output ---------------------------------------------------------------------------------

def _ms(d: dict, q: str) -> str:
    return "-" if d[q] is None else f"{d[q] * 1e3:.0f}"


def table(runs: list[Run], slo: SLO) -> str:
    key = runs[0].load.key if runs else "rate"
    head = (f"{key:>11} {'reqs':>5} {'ok':>5} {'fail':>5} {'rej':>5} {'req/s':>7} {'tok/s':>8} "
            f"{'TTFT p50/p90/p99 ms':>21} {'TPOT p50/p90/p99 ms':>21} {'ITL p90':>8} {'e2e p90 s':>9} {'SLO ok':>7}")
    lines = [head]
    for r in runs:
        s = r.summary
        ttft = "/".join(_ms(s["ttft_s"], q) for q in ("p50", "p90", "p99"))
        tpot = "/".join(_ms(s["tpot_s"], q) for q in ("p50", "p90", "p99"))
        e2e = "-" if s["e2e_s"]["p90"] is None else f"{s['e2e_s']['p90']:.2f}"
        lines.append(f"{r.load.x:>11g} {s['total']:>5} {s['ok']:>5} {s['failed']:>5} {s['rejected']:>5} "
                     f"{s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} {ttft:>21} {tpot:>21} "
                     f"{_ms(s['itl_s'], 'p90'):>8} {e2e:>9} {s['slo_attainment']:>7.0%}")
    g = goodput(runs)
    lines.append(f"goodput: {'none (no run passed)' if g is None else f'{g:g} req/s'} "
                 f"(>= {GOOD_ATTAINMENT:.0%} of requests with TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s)")
    return "\n".join(lines)


def result_json(config: dict, runs: list[Run]) -> dict:
    return {"config": config, "runs": [r.to_json() for r in runs], "goodput_rps": goodput(runs)}


def plan_of(args: argparse.Namespace) -> Plan:
    params = {}
    if args.workload == "fixed":
        params = {k: v for k, v in (("input_len", args.input_len), ("output_len", args.output_len)) if v is not None}
    return Plan(args.workload, params, args.num_requests, args.duration, SLO(args.slo_ttft, args.slo_tpot),
                args.seed, args.pause)


def load_tokenizer(args: argparse.Namespace):
    from common.model_source import resolve_model
    from common.tokenizer import Tokenizer

    try:
        return Tokenizer.from_pretrained(args.tokenizer or resolve_model(args.model))
    except (ValueError, OSError) as e:
        raise SystemExit(f"pdserve bench: no tokenizer for {args.model!r} ({e}); "
                         "pass --tokenizer FOLDER (a Hugging Face model folder)") from None


def config_of(args: argparse.Namespace, plan: Plan) -> dict:
    return {"url": args.url, "model": args.model, "workload": plan.workload, "params": plan.params,
            "num_requests": plan.num_requests, "duration_s": plan.duration_s, "slo_ttft_s": plan.slo.ttft_s,
            "slo_tpot_s": plan.slo.tpot_s, "seed": plan.seed, "loads": [{lo.key: lo.x} for lo in args.loads],
            "goodput_search": args.goodput_search, "good_attainment": GOOD_ATTAINMENT}
