"""A discrete-event simulator of the prefill and decode pools, driven by a `Profile`.

It follows the system's own rules, not a queueing formula:
- prefill workers take waiting prompts first come first served, in chunks that fill the
  step's token budget; a finished prompt's first token and KV reach the decode worker after
  the profile's transfer time; the gateway routes a prompt to the prefill worker with the
  fewest queued tokens and the request to the decode worker with the fewest outstanding
  tokens;
- decode workers run continuous batching: requests whose KV arrived join at the next step
  (while `max_num_seqs` and the KV capacity allow), every step gives each running request
  one token and costs `decode_step_s(batch, mean context)`;
- aggregated workers (no prefill pool) run decodes first, then prefill chunks in the rest
  of the step's budget, paying both cost models in one step.

Times are seconds from the first arrival. `simulate` fills each request's first-token and
finish times and its token times; `summarize` turns them into percentiles and SLO
attainment; `goodput` searches the highest arrival rate that meets the SLOs for 90% of
requests.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from deploy.profile import Profile

TARGET_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Pools:
    prefill: int  # 0: aggregated, every worker prefills and decodes
    decode: int

    def __str__(self) -> str:
        return f"aggregated x{self.decode}" if self.prefill == 0 else f"{self.prefill}P + {self.decode}D"


@dataclass(eq=False)  # compared by identity: two requests may have equal fields
class SimRequest:
    arrival: float
    prompt: int
    output: int
    first_token: float = math.inf
    finish: float = math.inf
    token_times: list[float] = field(default_factory=list)  # decode tokens (after the first)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return 0.0 if self.output <= 1 else (self.finish - self.first_token) / (self.output - 1)


@dataclass(eq=False)
class _Prefilling:
    req: SimRequest
    done: int = 0  # prompt tokens already computed


class _Sim:
    def __init__(self, profile: Profile, pools: Pools, max_num_seqs: int):
        self.p, self.pools, self.max_num_seqs = profile, pools, max_num_seqs
        self.budget = profile.max_num_batched_tokens
        self.events: list = []
        self.seq = itertools.count()
        n_decode = pools.decode
        self.prefill_queue = [deque() for _ in range(pools.prefill)]
        self.prefill_busy = [False] * pools.prefill
        self.decode_wait = [deque() for _ in range(n_decode)]  # KV arrived (or, aggregated: to prefill)
        self.running: list[list[list]] = [[] for _ in range(n_decode)]  # [req, generated]
        self.agg_prefilling: list[deque] = [deque() for _ in range(n_decode)]
        self.decode_busy = [False] * n_decode
        self.outstanding = [0] * n_decode  # prompt + output tokens routed to each decode worker

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self, requests: list[SimRequest]) -> None:
        for r in requests:
            self.at(r.arrival, self.arrive, r)
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            fn(t, *args)

    # ---- gateway ----
    def arrive(self, t: float, req: SimRequest) -> None:
        d = min(range(self.pools.decode), key=lambda i: self.outstanding[i])
        self.outstanding[d] += req.prompt + req.output
        if self.pools.prefill == 0:
            self.agg_prefilling[d].append(_Prefilling(req))
            self.kick_decode(t, d)
            return
        w = min(range(self.pools.prefill), key=lambda i: sum(x.req.prompt - x.done for x, _ in self.prefill_queue[i]))
        self.prefill_queue[w].append((_Prefilling(req), d))
        if not self.prefill_busy[w]:
            self.prefill_step(t, w)

    # ---- prefill pool ----
    def _chunks(self, queue, budget: int) -> list[tuple[object, int]]:
        chunks = []
        for item in queue:
            if budget <= 0:
                break
            state = item[0] if isinstance(item, tuple) else item
            take = min(state.req.prompt - state.done, budget)
            chunks.append((item, take))
            budget -= take
        return chunks

    def _prefill_cost(self, chunks, first_constant: bool) -> float:
        cost = 0.0
        for i, (item, take) in enumerate(chunks):
            state = item[0] if isinstance(item, tuple) else item
            cost += self.p.prefill_step_s(take, state.done, with_constant=first_constant and i == 0)
        return cost

    def prefill_step(self, t: float, w: int) -> None:
        chunks = self._chunks(self.prefill_queue[w], self.budget)
        if not chunks:
            self.prefill_busy[w] = False
            return
        self.prefill_busy[w] = True
        self.at(t + self._prefill_cost(chunks, True), self.prefill_done, w, chunks)

    def prefill_done(self, t: float, w: int, chunks) -> None:
        for (state, d), take in chunks:
            state.done += take
            if state.done == state.req.prompt:
                self.prefill_queue[w].remove((state, d))
                arrive = t + self.p.transfer_s
                state.req.first_token = arrive
                self.at(arrive, self.kv_arrived, d, state.req)
        self.prefill_step(t, w)

    # ---- decode pool (and aggregated workers) ----
    def kv_arrived(self, t: float, d: int, req: SimRequest) -> None:
        if req.output <= 1:
            self.finish(t, d, req)
            return
        self.decode_wait[d].append(req)
        self.kick_decode(t, d)

    def kick_decode(self, t: float, d: int) -> None:
        if not self.decode_busy[d]:
            self.decode_step(t, d)

    def _kv_used(self, d: int) -> int:
        used = sum(r.prompt + r.output for r, _ in self.running[d])
        return used + sum(x.req.prompt + x.req.output for x in self.agg_prefilling[d] if x.done > 0)

    def decode_step(self, t: float, d: int) -> None:
        running, wait = self.running[d], self.decode_wait[d]
        while wait and len(running) < self.max_num_seqs and \
                self._kv_used(d) + wait[0].prompt + wait[0].output <= self.p.kv_tokens:
            running.append([wait.popleft(), 0])
        cost, chunks = 0.0, []
        if running:
            context = statistics.fmean(r.prompt + g for r, g in running)
            cost = self.p.decode_step_s(len(running), context)
        if self.pools.prefill == 0:  # aggregated: prefill chunks in the rest of the budget
            room = self.max_num_seqs - len(running)
            admitted = [x for x in self.agg_prefilling[d] if x.done > 0]
            kv = self._kv_used(d)
            for x in self.agg_prefilling[d]:  # admit new prompts while seats and KV allow
                if x.done == 0 and len(admitted) < room and kv + x.req.prompt + x.req.output <= self.p.kv_tokens:
                    admitted.append(x)
                    kv += x.req.prompt + x.req.output
            chunks = self._chunks(admitted, self.budget - len(running))
            cost += self._prefill_cost(chunks, not running)
        if not running and not chunks:
            self.decode_busy[d] = False
            return
        self.decode_busy[d] = True
        self.at(t + cost, self.decode_done, d, [r for r, _ in running], chunks)

    def decode_done(self, t: float, d: int, stepped: list[SimRequest], chunks) -> None:
        still, stepped_ids = [], {id(r) for r in stepped}
        for entry in self.running[d]:
            req = entry[0]
            if id(req) in stepped_ids:
                entry[1] += 1
                req.token_times.append(t)
                if entry[1] >= req.output - 1:
                    self.finish(t, d, req)
                    continue
            still.append(entry)
        self.running[d] = still
        for state, take in chunks:
            state.done += take
            if state.done == state.req.prompt:
                self.agg_prefilling[d].remove(state)
                state.req.first_token = t
                if state.req.output <= 1:
                    self.finish(t, d, state.req)
                else:
                    self.running[d].append([state.req, 0])
        self.decode_step(t, d)

    def finish(self, t: float, d: int, req: SimRequest) -> None:
        req.finish = t
        self.outstanding[d] -= req.prompt + req.output


def simulate(profile: Profile, pools: Pools, requests: list[tuple[float, int, int]],
             max_num_seqs: int = 64) -> list[SimRequest]:
    """Run (arrival_s, prompt_tokens, output_tokens) requests through the pools."""
    if pools.decode < 1 or pools.prefill < 0:
        raise ValueError(f"pools need at least one decode worker and no negative count: {pools}")
    reqs = [SimRequest(a, max(1, p), max(1, o)) for a, p, o in requests]
    too_big = [r for r in reqs if r.prompt + r.output > profile.kv_tokens]
    if too_big:
        raise ValueError(f"a request of {too_big[0].prompt}+{too_big[0].output} tokens exceeds a worker's KV "
                         f"capacity ({profile.kv_tokens} tokens)")
    _Sim(profile, pools, max_num_seqs).run(reqs)
    if profile.ttft_overhead_s:  # the serving path's latency: every token reaches the client that much later
        for r in reqs:
            r.first_token += profile.ttft_overhead_s
            r.finish += profile.ttft_overhead_s
            r.token_times = [t + profile.ttft_overhead_s for t in r.token_times]
    return reqs


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(reqs: list[SimRequest], slo_ttft: float, slo_tpot: float) -> dict:
    ttft = [r.ttft for r in reqs]
    tpot = [r.tpot for r in reqs if r.output > 1]
    itl = [b - a for r in reqs for a, b in zip([r.first_token, *r.token_times], r.token_times)]
    good = sum(1 for r in reqs if r.ttft <= slo_ttft and r.tpot <= slo_tpot)
    return {"requests": len(reqs), "attainment": good / len(reqs) if reqs else math.nan,
            **{f"ttft_p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}": percentile(tpot, q) for q in (50, 90, 99)},
            **{f"itl_p{q}": percentile(itl, q) for q in (50, 90, 99)},
            "mean_ttft": statistics.fmean(ttft) if ttft else math.nan,
            "mean_tpot": statistics.fmean(tpot) if tpot else math.nan}


def poisson_requests(lengths: list[tuple[int, int]], rate: float, seed: int = 0) -> list[tuple[float, int, int]]:
    """The same lengths and the same exponential draws at any rate (common random numbers)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for p, o in lengths:
        out.append((t, p, o))
        t += rng.expovariate(1.0) / rate
    return out


def goodput(profile: Profile, pools: Pools, lengths: list[tuple[int, int]], slo_ttft: float, slo_tpot: float,
            seed: int = 0, start_rate: float = 0.25, iterations: int = 7) -> tuple[float, dict]:
    """The highest Poisson rate (req/s) with >= 90% SLO attainment, and the summary there."""

    def at(rate: float) -> dict:
        return summarize(simulate(profile, pools, poisson_requests(lengths, rate, seed)), slo_ttft, slo_tpot)

    lo, lo_summary, hi = 0.0, None, start_rate
    while True:  # double until the SLOs fail
        s = at(hi)
        if s["attainment"] < TARGET_ATTAINMENT:
            break
        lo, lo_summary, hi = hi, s, hi * 2
        if hi > 1e4:
            return lo, lo_summary
    for _ in range(iterations):  # then bisect
        mid = (lo + hi) / 2
        s = at(mid)
        if s["attainment"] >= TARGET_ATTAINMENT:
            lo, lo_summary = mid, s
        else:
            hi = mid
    return lo, lo_summary or at(max(lo, start_rate / 8))
