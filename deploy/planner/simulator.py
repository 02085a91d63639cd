"""A discrete-event simulator of the prefill and decode pools, driven by a `Profile`.

It runs the system's own control code on a virtual clock, and prices each step instead of
running it:
- every worker is a `SimWorker` (deploy/planner/sim_worker.py): pdserve's own `Scheduler` and
  `KVCacheManager`, so chunking, chunk caps and top-ups, admission under the KV budget,
  preemption and remote-prefill reservations are the engine's decisions, not a model of
  them; each step costs `Profile.step_s` of its shape;
- a worker's loop mirrors worker/loop.py: commands that arrived (new requests, KV that
  landed) are applied at the top of an iteration, then one step is scheduled and runs; what
  arrives during a step waits for the next iteration;
- workers share the machine: a step runs slower while other workers are in steps too, by
  the profile's `per_busy` term (deploy/planner/step_fit.py), its pace changing each time one of
  them starts or ends a step; and each worker's steps stray from their price together for
  a while (a slow stretch of the host), by a noise process fitted on the deployment's step
  logs (`noise_sd`, `noise_s`), drawn from a seeded generator;
- the gateway routes with its own `Router` (the decode worker with the fewest outstanding
  tokens among those with KV headroom, prefill workers ranked by prompt affinity, fed each
  worker's queue and free blocks as Stats would be);
- disaggregated, a decode worker reserves a prompt's blocks in a step's schedule and sends
  the Prefill then (arriving `rpc_s` later); the prefill worker queues and chunks it with
  its own scheduler, pushes the KV when the prompt is done (`transfer_s`, waiting up to
  5 ms for it before its next step, as prefill/worker.py does), and the decode worker
  sees the KV at its first iteration after the reply arrives: the first token goes out
  then, and the request decodes from the next step on;
- aggregated workers (no prefill pool) prefill locally in their decode batches.

Times are seconds from the first arrival. `simulate` fills each request's first-token and
finish times and its token times; `summarize` turns them into percentiles and SLO
attainment; `goodput` searches the highest arrival rate that meets the SLOs for 90% of
requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.planner.pools import Pools
from deploy.planner.profile import Profile
from deploy.planner.slo import QUANTILES, SLO, attainment, passes, percentile
from deploy.planner.step_fit import TOKEN_WINDOW_S

LAST_PUSH_WAIT_S = 0.005  # prefill/worker.py's _LAST_PUSH_WAIT_S: a finishing step's wait for its pushes
_MAX_MODEL_LEN = 1 << 30  # the profile's KV capacity bounds a request, not a context limit


class _Noise:
    """One worker's step-time noise: log(step / price) follows an Ornstein-Uhlenbeck process
    of stationary sd `sd` and time constant `tau_s`, sampled at each step's start; the
    factor's mean is 1 (the fitted price is the mean)."""

    def __init__(self, sd: float, tau_s: float, rng: random.Random):
        self.sd, self.tau_s, self.rng = sd, tau_s, rng
        self.z, self.t = (rng.gauss(0.0, sd) if sd > 0 else 0.0), 0.0

    def factor(self, t: float) -> float:
        if self.sd <= 0 or self.tau_s <= 0:
            return 1.0
        keep = math.exp(-max(0.0, t - self.t) / self.tau_s)
        self.z = self.z * keep + self.sd * math.sqrt(1 - keep * keep) * self.rng.gauss(0.0, 1.0)
        self.t = t
        return math.exp(self.z - self.sd * self.sd / 2)


@dataclass(eq=False)
class _Stepping:
    """A worker's step in progress: its costs (Profile.step_parts), how much of it is left,
    and the other workers' busy share it runs at since `since`."""

    out: object  # the SchedulerOutput
    engine_s: float
    busy_s: float
    loop_s: float
    since: float
    left: float = 1.0  # of the whole step, at `since`
    others_busy: float = 0.0
    version: int = -1  # which scheduled end is current (a change of pace schedules a new one); -1: none yet

    def seconds(self) -> float:
        """The whole step's duration at the current pace."""
        return self.engine_s + self.busy_s * self.others_busy + self.loop_s


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


class _Sim:
    def __init__(self, profile: Profile, pools: Pools, max_num_seqs: int, seed: int = 0):
        # The engine's scheduler imports torch (engine.config): not for every importer of Pools.
        from engine.config import SchedulerConfig
        from gateway.routing.router import Router

        from deploy.planner.sim_worker import SIM_TOKEN, SimWorker, StepShape, sim_prompt

        self.token, self.shape_of, self.new_prompt = SIM_TOKEN, StepShape.of, sim_prompt
        self.p = profile
        config = SchedulerConfig(profile.max_num_batched_tokens, max_num_seqs, _MAX_MODEL_LEN)
        blocks = profile.kv_tokens // profile.block_size
        self.decode = [SimWorker(f"decode-{i}", config, blocks, profile.block_size) for i in range(pools.decode)]
        self.prefill = [SimWorker(f"prefill-{i}", config, blocks, profile.block_size) for i in range(pools.prefill)]
        self.workers = {w.name: w for w in self.decode + self.prefill}
        self.decode_names = {w.name for w in self.decode}
        self.kind = "decode" if pools.prefill else "aggregated"  # which of the profile's loop terms price them
        self.streamed: deque[tuple[float, int]] = deque()  # (time, tokens) the decode workers streamed
        self.streamed_in_window = 0
        # A prefill worker's measured iterations already hold its wait for its pushes.
        self.push_wait_s = 0.0 if "prefill" in profile.loop_terms else min(profile.transfer_s, LAST_PUSH_WAIT_S)
        self.router = Router([w.name for w in self.decode], [w.name for w in self.prefill], profile.block_size)
        self.states = {s.address: s for s in self.router.decode + self.router.prefill}  # the gateway's view
        self.events: list = []
        self.seq = itertools.count()
        self.inbox: dict[str, list[Callable[[float], None]]] = {name: [] for name in self.workers}
        self.requests: dict[str, tuple[SimRequest, list[int]]] = {}  # request id -> (request, prompt ids)
        self.prefill_of: dict[str, str] = {}  # request id -> the prefill worker asked
        self.decode_of: dict[str, str] = {}  # request id -> its decode worker
        self.stepping: dict[str, _Stepping] = {}  # worker -> its step in progress
        rng = random.Random(seed)
        self.noise = {name: _Noise(*profile.step_noise(self.kind_of(name)), rng) for name in self.workers}

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self, requests: list[SimRequest]) -> None:
        for i, r in enumerate(requests):
            rid = f"sim-{i}"
            self.requests[rid] = (r, self.new_prompt(r.prompt))
            self.at(r.arrival, self.arrive, rid)
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            fn(t, *args)

    # ---- messages between processes ----
    def send(self, t: float, worker: str, command: Callable[[float], None]) -> None:
        """`command` reaches `worker`'s loop at t: run at its next iteration (now, if idle)."""
        self.inbox[worker].append(command)
        w = self.workers[worker]
        if not w.busy:
            w.busy = True  # an iteration is due: later messages join its inbox
            self.at(t, self.iterate, worker)

    # ---- gateway ----
    def arrive(self, t: float, rid: str) -> None:
        req, prompt = self.requests[rid]
        for w in self.decode + self.prefill:  # fresh Stats
            kv = w.kv
            self.states[w.name].observe(kv.num_free_blocks, kv.num_total_blocks, kv.block_size, w.waiting_tokens())
        target = self.router.pick_decode(req.prompt)
        target.outstanding_tokens += req.prompt + req.output
        prefill = self.router.rank_prefill(prompt)
        self.decode_of[rid] = target.address
        remote = bool(prefill)
        if remote:
            self.prefill_of[rid] = prefill[0]

        def admit(now: float) -> None:
            self.workers[target.address].add(rid, prompt, req.output, remote_prefill=remote)
        self.send(t + self.p.rpc_s, target.address, admit)

    def finish(self, t: float, rid: str) -> None:
        req, _ = self.requests[rid]
        req.finish = t
        state = self.states[self.decode_of[rid]]
        state.outstanding_tokens -= req.prompt + req.output

    # ---- a worker's loop ----
    def iterate(self, t: float, name: str) -> None:
        w = self.workers[name]
        commands, self.inbox[name] = self.inbox[name], []
        for command in commands:
            command(t)
        if not w.has_work():
            w.busy = False
            return
        out = w.scheduler.schedule()
        for rp in out.remote_prefills:  # the Prefill goes out before the step runs
            self.ask_prefill(t, rp.seq.request_id, name)
        if out.is_empty:  # everything waits for KV from elsewhere: idle until a message comes
            w.busy = False
            return
        w.busy = True
        noise = self.noise[name].factor(t)
        engine_s, busy_s, loop_s = self.p.step_parts(self.shape_of(out), self.kind_of(name), self.token_rate(t))
        self.stepping[name] = _Stepping(out, engine_s * noise, busy_s * noise, loop_s * noise, since=t)
        self.share(t)

    def kind_of(self, name: str) -> str:
        """Which of the profile's loop terms price the worker's steps."""
        return self.kind if name in self.decode_names else "prefill"

    def share(self, t: float) -> None:
        """The workers in steps at t go on at the pace the others' being busy sets; a step
        whose pace changed gets a new end."""
        busy = (len(self.stepping) - 1) / max(1, len(self.workers) - 1)
        for name, run in self.stepping.items():
            if run.version >= 0 and (busy == run.others_busy or run.busy_s == 0.0):
                continue
            run.left -= (t - run.since) / run.seconds() if run.version >= 0 else 0.0
            run.since, run.others_busy, run.version = t, busy, next(self.seq)  # unique: older ends never match
            self.at(t + max(0.0, run.left) * run.seconds(), self.stepped, name, run.version)

    def stream(self, t: float, tokens: int) -> None:
        self.streamed.append((t, tokens))
        self.streamed_in_window += tokens

    def token_rate(self, t: float) -> float:
        """Tokens streamed per second over the window before t (what contention is priced at)."""
        while self.streamed and self.streamed[0][0] <= t - TOKEN_WINDOW_S:
            self.streamed_in_window -= self.streamed.popleft()[1]
        return self.streamed_in_window / TOKEN_WINDOW_S

    def stepped(self, t: float, name: str, version: int) -> None:
        run = self.stepping.get(name)
        if run is None or run.version != version:  # its pace changed since this end was set
            return
        del self.stepping[name]
        self.share(t)
        w = self.workers[name]
        updates = w.apply(run.out)
        if w in self.prefill:
            self.prefilled(t, name, updates)
            return
        self.stream(t, len(updates))
        for u in updates:
            req, _ = self.requests[u.request_id]
            if req.first_token == math.inf:
                req.first_token = t
            else:
                req.token_times.append(t)
            if u.finish_reason is not None:
                self.finish(t, u.request_id)
        self.iterate(t, name)

    # ---- remote prefill ----
    def ask_prefill(self, t: float, rid: str, decode: str) -> None:
        _, prompt = self.requests[rid]
        worker = self.prefill_of[rid]

        def queue(now: float) -> None:
            self.workers[worker].add(rid, prompt, 1, hold_blocks=True)
        self.send(t + self.p.rpc_s, worker, queue)

    def prefilled(self, t: float, name: str, updates) -> None:
        """A prefill worker's step ended: push the prompts it finished, wait briefly for the
        pushes, go on."""
        done = [u.request_id for u in updates if u.new_token_ids]
        for rid in done:
            self.at(t + self.p.transfer_s, self.pushed, name, rid)
        wait = self.push_wait_s if done else 0.0
        self.at(t + wait, self.iterate, name)  # still busy: messages meanwhile wait for that iteration

    def pushed(self, t: float, name: str, rid: str) -> None:
        self.send(t, name, lambda now: self.workers[name].scheduler.release(rid))
        decode = self.decode_of[rid]

        def kv_ready(now: float) -> None:
            update = self.workers[decode].scheduler.remote_kv_ready(rid, self.token)
            if update is None:
                return
            req, _ = self.requests[rid]
            req.first_token = now  # the decode worker streams the first token as it sees the KV
            self.stream(now, 1)
            if update.finish_reason is not None:
                self.finish(now, rid)
        self.send(t + self.p.rpc_s, decode, kv_ready)


def simulate(profile: Profile, pools: Pools, requests: list[tuple[float, int, int]],
             max_num_seqs: int = 64, seed: int = 0) -> list[SimRequest]:
    """Run (arrival_s, prompt_tokens, output_tokens) requests through the pools (`seed`: the
    steps' noise, where the profile has it)."""
    if pools.decode < 1 or pools.prefill < 0:
        raise ValueError(f"pools need at least one decode worker and no negative count: {pools}")
    reqs = [SimRequest(a, max(1, p), max(1, o)) for a, p, o in requests]
    capacity = profile.kv_tokens // profile.block_size * profile.block_size
    too_big = [r for r in reqs if r.prompt + r.output > capacity]
    if too_big:
        raise ValueError(f"a request of {too_big[0].prompt}+{too_big[0].output} tokens exceeds a worker's KV "
                         f"capacity ({profile.kv_tokens} tokens)")
    _Sim(profile, pools, max_num_seqs, seed).run(reqs)
    if profile.ttft_overhead_s:  # the serving path's latency: every token reaches the client that much later
        for r in reqs:
            r.first_token += profile.ttft_overhead_s
            r.finish += profile.ttft_overhead_s
            r.token_times = [t + profile.ttft_overhead_s for t in r.token_times]
    return reqs


def summarize(reqs: list[SimRequest], slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles (deploy/planner/slo.py's; nan where there is nothing to take one of), means
    and SLO attainment of simulated requests."""
    ttft = [r.ttft for r in reqs]
    tpot = [r.tpot for r in reqs if r.output > 1]
    itl = [b - a for r in reqs for a, b in zip([r.first_token, *r.token_times], r.token_times)]
    slo = SLO(slo_ttft, slo_tpot)
    good = sum(slo.met(r.ttft, r.tpot if r.output > 1 else None) for r in reqs)
    return {"requests": len(reqs), "attainment": attainment(good, len(reqs)),
            **{f"ttft_p{q}": _nan_if_none(percentile(ttft, q)) for q in QUANTILES},
            **{f"tpot_p{q}": _nan_if_none(percentile(tpot, q)) for q in QUANTILES},
            **{f"itl_p{q}": _nan_if_none(percentile(itl, q)) for q in QUANTILES},
            "mean_ttft": statistics.fmean(ttft) if ttft else math.nan,
            "mean_tpot": statistics.fmean(tpot) if tpot else math.nan}


def _nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


def poisson_requests(lengths: list[tuple[int, int]], rate: float, seed: int = 0) -> list[tuple[float, int, int]]:
    """The same lengths and the same exponential draws at any rate (common random numbers)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for p, o in lengths:
        out.append((t, p, o))
        t += rng.expovariate(1.0) / rate
    return out


def replay(profile: Profile, pools: Pools, requests: list[tuple[float, int, int]], replays: int = 1,
           max_num_seqs: int = 64) -> list[list[SimRequest]]:
    """The requests simulated `replays` times, one noise seed each (once where the profile's
    steps have no noise): pooled, percentiles that one seed's luck does not set."""
    return [simulate(profile, pools, requests, max_num_seqs, seed) for seed in range(replays if profile.noisy else 1)]


def pooled(runs: list[list[SimRequest]]) -> list[SimRequest]:
    """replay()'s runs as one list of requests."""
    return [r for run in runs for r in run]


def goodput(profile: Profile, pools: Pools, lengths: list[tuple[int, int]], slo_ttft: float, slo_tpot: float,
            seed: int = 0, start_rate: float = 0.25, iterations: int = 7, replays: int = 1) -> tuple[float, dict]:
    """The highest Poisson rate (req/s) with >= 90% SLO attainment, and the summary there
    (each rate's requests simulated `replays` times where the steps are noisy)."""

    def at(rate: float) -> dict:
        return summarize(pooled(replay(profile, pools, poisson_requests(lengths, rate, seed), replays)),
                         slo_ttft, slo_tpot)

    lo, lo_summary, hi = 0.0, None, start_rate
    while True:  # double until the SLOs fail
        s = at(hi)
        if not passes(s["attainment"]):
            break
        lo, lo_summary, hi = hi, s, hi * 2
        if hi > 1e4:
            return lo, lo_summary
    for _ in range(iterations):  # then bisect
        mid = (lo + hi) / 2
        s = at(mid)
        if passes(s["attainment"]):
            lo, lo_summary = mid, s
        else:
            hi = mid
    return lo, lo_summary or at(max(lo, start_rate / 8))
