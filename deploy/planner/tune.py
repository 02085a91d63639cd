"""`pdserve tune`: which (prefill, decode) split of N workers serves a workload best.

For every split of N workers, and for N aggregated workers, the simulator finds the
goodput (the highest Poisson rate at which >= 90% of requests meet both SLOs); the table
lists them and the best is the recommendation.

`pdserve tune --validate BENCH.json --prefill P --decode D` instead replays a measured
`pdserve bench` run (its arrivals and lengths) through the simulator and prints the
simulator's error on p90 TTFT, p90 TPOT and goodput; with `--level LOGS` (the validated
deployment's step logs) each run is simulated at the host's level while it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from pathlib import Path

from deploy.planner.pools import Pools, splits
from deploy.planner.profile import Profile
from deploy.planner.simulator import goodput, pooled, replay, simulate, summarize
from deploy.planner.slo import SLO, TARGET_ATTAINMENT, attainment, passes, percentile
from deploy.planner.slo import goodput as highest_passing_rate


REPLAYS = 5  # simulated replays of a run (seeds of the steps' noise), pooled


def tune(profile: Profile, lengths: list[tuple[int, int]], slo_ttft: float, slo_tpot: float,
         workers: int, seed: int = 0) -> list[tuple[Pools, float, dict]]:
    """(pools, goodput req/s, summary at that rate) for each split, best first."""
    rows = [(pools, *goodput(profile, pools, lengths, slo_ttft, slo_tpot, seed, replays=REPLAYS))
            for pools in splits(workers)]
    return sorted(rows, key=lambda r: -r[1])


def validate(profile: Profile, pools: Pools, bench: dict, slo_ttft: float, slo_tpot: float,
             resamples: int = 1000, replays: int = REPLAYS, level_steps: list | None = None) -> list[dict]:
    """Per measured run: measured vs simulated p90 TTFT / TPOT and attainment, same requests,
    with a 95% bootstrap interval on each p90's relative error (the requests resampled, each
    drawn set compared measured against simulated: how far the error can be trusted). Where
    the profile's steps are noisy (deploy/planner/step_fit.fit_noise) the run is simulated `replays`
    times, one noise seed each, and the simulated figures pool them: one replay's p90 near
    capacity moves by tens of percent from seed to seed, as a measured run's would.

    With `level_steps` (the validated deployment's step log, deploy/planner/step_fit.read_steps) each
    run is simulated at the host's level while it ran (step_fit.levels over its span): the
    one number per kind of worker that the online planner corrects from the workers' step
    times too. Every other term stays as the profile has it."""
    if "deployments" in bench:
        raise ValueError(f"a comparison file: validate one of its deployments ({', '.join(bench['deployments'])}) "
                         "with --deployment NAME")
    rows = []
    for run in bench["runs"]:
        requests, tpots, done = _requests_of(run)
        if not done:
            continue
        at_level, level = profile, {}
        if level_steps is not None:
            at_level, level = _at_level(profile, run, level_steps)
        replayed = replay(at_level, pools, requests, replays)
        sim = summarize(pooled(replayed), slo_ttft, slo_tpot)
        each = list(zip(*replayed))  # per request: its simulated copies
        measured_ttft = _p90([r["ttft_s"] for r in done])
        measured_tpot = _p90(tpots)
        pairs_ttft = [(r["ttft_s"], [c.ttft for c in copies]) for r, copies in zip(done, each)]
        pairs_tpot = [(r["tpot_s"], [c.tpot for c in copies]) for r, copies in zip(done, each)
                      if r.get("tpot_s") is not None]
        rows.append({"rate": run.get("rate"), "requests": len(done), "replays": len(replayed),
                     "measured_ttft_p90": measured_ttft, "sim_ttft_p90": sim["ttft_p90"],
                     "ttft_p90_error_ci": p90_error_interval(pairs_ttft, resamples),
                     "measured_tpot_p90": measured_tpot, "sim_tpot_p90": sim["tpot_p90"],
                     "tpot_p90_error_ci": p90_error_interval(pairs_tpot, resamples),
                     "measured_attainment": _attainment(run, slo_ttft, slo_tpot),
                     "sim_attainment": sim["attainment"], "level": level})
    return rows


def _at_level(profile: Profile, run: dict, steps: list) -> tuple[Profile, dict[str, float]]:
    """The profile with each kind's scale measured on the steps logged during `run`."""
    from deploy.planner.step_fit import levels

    if not profile.loop_terms:
        raise ValueError("a level needs a profile with step terms (fit them with --steps first)")
    if run.get("started_at") is None:
        raise ValueError(f"the run at rate {run.get('rate')} has no start time (a bench file from an older "
                         "pdserve bench): its steps cannot be told apart from the other runs'")
    level = levels(profile.step_coef, profile.loop_terms, steps, run["started_at"],
                   run["started_at"] + run["duration_s"])
    if not level:
        raise ValueError(f"no logged steps during the run at rate {run.get('rate')}: the log folder is "
                         "another deployment's, or its workers ran without PDSERVE_STEP_LOG=1")
    terms = {kind: [level.get(kind, t[0]), *t[1:]] for kind, t in profile.loop_terms.items()}
    return dataclasses.replace(profile, loop_terms=terms), level


def p90_error_interval(pairs: list[tuple[float, float | list[float]]], resamples: int = 1000,
                       seed: int = 0) -> list[float]:
    """The 95% bootstrap interval of (simulated p90 - measured p90) / measured p90 over
    (measured, simulated) pairs of the same requests (simulated: one value, or a list of one
    per replay); [nan, nan] with too few to say."""
    if len(pairs) < 10 or resamples < 1:
        return [math.nan, math.nan]
    pairs = [(m, s if isinstance(s, list) else [s]) for m, s in pairs]
    rng = random.Random(seed)
    errors = []
    for _ in range(resamples):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        measured = _p90([m for m, _ in drawn])
        if measured > 0:
            errors.append((_p90([x for _, s in drawn for x in s]) - measured) / measured)
    if not errors:
        return [math.nan, math.nan]
    errors.sort()
    return [errors[int(0.025 * (len(errors) - 1))], errors[int(0.975 * (len(errors) - 1))]]


def calibrate(profile: Profile, pools: Pools, bench: dict, slo_ttft: float, slo_tpot: float) -> Profile:
    """The profile with the serving overheads measured on the bench's runs (what HTTP, gRPC,
    streaming and the other processes on the same cores add). The decode steps' share is
    `step_overhead_s + token_overhead_s * sequences in the step` (streaming costs per token):
    the two are fitted so that the simulator's mean TPOT matches the lowest-rate run and the
    highest-rate one that still met the SLOs for 90% of its requests (past saturation the
    queue, not the step, sets the batch), whose decode batches differ (a few rounds: a slower
    step makes bigger batches); one run, or batches too alike, fit the per-step part alone.
    Then the mean TTFT the simulator misses on the lowest-rate run becomes a per-request
    latency."""
    runs = sorted((r for r in bench.get("runs", []) if r.get("rate")), key=lambda r: r["rate"])
    if not runs:
        return profile
    profile = dataclasses.replace(profile, ttft_overhead_s=0.0, step_overhead_s=0.0, token_overhead_s=0.0)
    if profile.loop_terms:  # the steps' costs come from the deployment's step logs: only the path's latency here
        return _calibrate_ttft(profile, pools, runs[0], slo_ttft, slo_tpot)
    served = [r for r in runs[1:] if passes(_attainment(r, slo_ttft, slo_tpot))]
    fitted = [_requests_of(r) for r in [runs[0], *served[-1:]]]
    fitted = [(reqs, tpots) for reqs, tpots, _ in fitted if tpots]
    for _ in range(4 if fitted else 0):
        points = []  # (mean decode batch, mean TPOT missed)
        for reqs, tpots in fitted:
            sim = simulate(profile, pools, reqs)
            missed = statistics.fmean(tpots) - summarize(sim, slo_ttft, slo_tpot)["mean_tpot"]
            points.append((_decode_batch(sim), missed))
        (b1, m1), (b2, m2) = points[0], points[-1]
        per_seq = (m2 - m1) / (b2 - b1) if len(points) > 1 and abs(b2 - b1) >= 1.0 else 0.0
        profile.token_overhead_s = max(0.0, profile.token_overhead_s + per_seq)
        profile.step_overhead_s = max(0.0, profile.step_overhead_s + m1 - per_seq * b1)
    return _calibrate_ttft(profile, pools, runs[0], slo_ttft, slo_tpot)


def _calibrate_ttft(profile: Profile, pools: Pools, run: dict, slo_ttft: float, slo_tpot: float) -> Profile:
    """The mean TTFT the simulator misses on `run` (the lowest rate) as a per-request latency."""
    reqs, _, done = _requests_of(run)
    sim = summarize(pooled(replay(profile, pools, reqs, REPLAYS)), slo_ttft, slo_tpot)
    profile.ttft_overhead_s = max(0.0, statistics.fmean(r["ttft_s"] for r in done) - sim["mean_ttft"])
    return profile


def _fit_steps(profile: Profile, roots: list[Path]) -> Profile | None:
    """The profile with the loop terms fitted on the step logs of each deployment under
    `roots` (one log folder per deployment: an aggregated one's, a disaggregated one's)."""
    from deploy.planner.step_fit import describe, fit, read_steps
    from deploy.observe.logs import log_files

    if not profile.step_coef:
        print("pdserve tune --steps: the profile has no step model (make it with this version's `pdserve profile`)",
              file=sys.stderr)
        return None
    terms = dict(profile.loop_terms)
    for root in roots:
        steps = list(read_steps(log_files([root])))
        fitted = fit(profile.step_coef, steps)
        if not fitted:
            print(f"pdserve tune --steps: no step lines under {root} (run the deployment with PDSERVE_STEP_LOG=1)",
                  file=sys.stderr)
            return None
        print(f"{root}: {len(steps)} logged steps: {describe(fitted)}")
        terms.update({kind: t.as_list() for kind, t in fitted.items()})
    return dataclasses.replace(profile, loop_terms=terms)


def _attainment(run: dict, slo_ttft: float, slo_tpot: float) -> float:
    """A measured run's attainment, as `pdserve bench` counts it: over every request sent."""
    slo = SLO(slo_ttft, slo_tpot)
    good = sum(r.get("status") == "ok" and slo.met(r["ttft_s"], r.get("tpot_s")) for r in run["requests"])
    return attainment(good, len(run["requests"]))


def _requests_of(run: dict) -> tuple[list[tuple[float, int, int]], list[float], list[dict]]:
    """A measured run's finished requests as simulator input, their TPOTs, and the records."""
    done = [r for r in run["requests"] if r.get("status") == "ok"]
    t0 = min(r["arrival_s"] for r in run["requests"])
    return ([(r["arrival_s"] - t0, r["prompt_tokens"], r["output_tokens"]) for r in done],
            [r["tpot_s"] for r in done if r.get("tpot_s") is not None], done)


def _decode_batch(reqs) -> float:
    """Mean sequences decoding at once over a simulated run (Little's law: decode time over span)."""
    decoding = [r for r in reqs if r.output > 1]
    if not decoding:
        return 0.0
    span = max(r.finish for r in decoding) - min(r.first_token for r in decoding)
    return sum(r.finish - r.first_token for r in decoding) / span if span > 0 else 1.0


def goodput_of(rows: list[dict], key: str) -> float:
    """The highest rate whose attainment (measured or simulated) reaches the target (0: none)."""
    return highest_passing_rate((r["rate"], r[key]) for r in rows if r["rate"] is not None) or 0.0


def _p90(values: list[float]) -> float:
    p90 = percentile(values, 90)
    return math.nan if p90 is None else p90


def _interval(ci: list[float]) -> str:
    if any(math.isnan(x) for x in ci):
        return "-"
    return f"[{ci[0]:+.0%}, {ci[1]:+.0%}]"


def _err(sim: float, measured: float) -> str:
    if not measured or math.isnan(measured) or math.isnan(sim):
        return "   -"
    return f"{(sim - measured) / measured:+5.0%}"


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="recommend a prefill/decode split from a profile (simulated goodput)")
    p.add_argument("--profile", required=True, help="from `pdserve profile`")
    p.add_argument("--workload", default="sharegpt", help="sharegpt | fixed | long-prompt (deploy/planner/workload.py)")
    p.add_argument("--input-len", type=int, help="fixed workload: prompt tokens")
    p.add_argument("--output-len", type=int, help="fixed workload: output tokens")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token")
    p.add_argument("--workers", type=int, default=2, help="total workers to split")
    p.add_argument("--requests", type=int, default=200, help="simulated requests per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validate", help="a `pdserve bench --json` file to replay instead")
    p.add_argument("--prefill", type=int, help="with --validate: the measured deployment's prefill workers")
    p.add_argument("--decode", type=int, help="with --validate: its decode workers")
    p.add_argument("--deployment", help="with --validate of a `pdserve bench --compare` file: which deployment")
    p.add_argument("--calibrate", action="store_true",
                   help="with --validate: first measure the serving overheads on the lowest-rate run")
    p.add_argument("--steps", action="append", type=Path,
                   help="a deployment's log folder, its workers run with PDSERVE_STEP_LOG=1 (repeatable: one "
                        "aggregated, one disaggregated): fit what its steps cost from their step logs first")
    p.add_argument("--level", type=Path,
                   help="with --validate: the validated deployment's log folder (PDSERVE_STEP_LOG=1): simulate "
                        "each run at the host's level while it ran, measured on its own steps")
    p.add_argument("--save-profile", help="with --calibrate or --steps: write the calibrated profile here (for tune)")
    p.add_argument("--json", help="write the table as JSON here")
    p.set_defaults(run=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
    except ValueError as e:
        print(f"pdserve tune: {e}", file=sys.stderr)
        return 2
    if args.level and not args.validate:
        print("pdserve tune: --level measures the host during a validated run: give --validate too", file=sys.stderr)
        return 2
    if args.steps:
        profile = _fit_steps(profile, args.steps)
        if profile is None:
            return 2
        if args.save_profile and not (args.validate and args.calibrate):
            profile.save(args.save_profile)
    if args.validate:
        return _run_validate(args, profile)
    from deploy.planner.workload import sample_workload

    params = {k: v for k, v in (("input_len", args.input_len), ("output_len", args.output_len)) if v is not None}
    lengths = sample_workload(args.workload, args.requests, args.seed, **params)
    rows = tune(profile, lengths, args.slo_ttft, args.slo_tpot, args.workers, args.seed)
    print(f"workload {args.workload} ({args.requests} requests), SLOs: TTFT <= {args.slo_ttft}s, "
          f"TPOT <= {args.slo_tpot}s, {args.workers} workers, profile {profile.model} {profile.dtype}")
    print(f"{'split':>16} {'goodput req/s':>14} {'per worker':>11} {'TTFT p90':>9} {'TPOT p90':>9}")
    for pools, rate, s in rows:
        print(f"{str(pools):>16} {rate:14.2f} {rate / args.workers:11.2f} {s['ttft_p90']:9.3f} {s['tpot_p90']:9.3f}")
    best = rows[0]
    print(f"recommendation: {best[0]} ({best[1]:.2f} req/s at >= {TARGET_ATTAINMENT:.0%} SLO attainment)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"prefill": p.prefill, "decode": p.decode, "goodput_rps": g, "summary": s}
                       for p, g, s in rows], f, indent=1)
    return 0


def _run_validate(args: argparse.Namespace, profile: Profile) -> int:
    if args.decode is None or args.prefill is None:
        print("pdserve tune --validate: give the measured deployment's --prefill and --decode", file=sys.stderr)
        return 2
    with open(args.validate) as f:
        bench = json.load(f)
    if args.deployment:
        bench = bench.get("deployments", {}).get(args.deployment)
        if bench is None:
            print(f"pdserve tune: {args.validate} has no deployment {args.deployment!r}", file=sys.stderr)
            return 2
    pools = Pools(args.prefill, args.decode)
    if args.calibrate and "runs" in bench:
        profile = calibrate(profile, pools, bench, args.slo_ttft, args.slo_tpot)
        steps = "" if profile.loop_terms else (f", +{profile.step_overhead_s * 1e3:.1f} ms per decode step and "
                                               f"{profile.token_overhead_s * 1e3:.2f} ms per sequence in it")
        print(f"calibrated on the runs: +{profile.ttft_overhead_s * 1e3:.0f} ms per first token{steps}")
        if args.save_profile:
            profile.save(args.save_profile)
    level_steps = None
    if args.level:
        from deploy.planner.step_fit import read_steps
        from deploy.observe.logs import log_files

        level_steps = list(read_steps(log_files([args.level])))
    try:
        rows = validate(profile, pools, bench, args.slo_ttft, args.slo_tpot, level_steps=level_steps)
    except ValueError as e:
        print(f"pdserve tune: {e}", file=sys.stderr)
        return 2
    print(f"{'rate':>6} {'reqs':>5} {'TTFT p90 meas':>13} {'sim':>7} {'err':>6} {'95% interval':>15} "
          f"{'TPOT p90 meas':>13} {'sim':>7} {'err':>6} {'95% interval':>15} {'attain meas':>11} {'sim':>5}")
    for r in rows:
        print(f"{r['rate'] or 0:6.2f} {r['requests']:5d} {r['measured_ttft_p90']:13.3f} {r['sim_ttft_p90']:7.3f} "
              f"{_err(r['sim_ttft_p90'], r['measured_ttft_p90']):>6} {_interval(r['ttft_p90_error_ci']):>15} "
              f"{r['measured_tpot_p90']:13.3f} {r['sim_tpot_p90']:7.3f} "
              f"{_err(r['sim_tpot_p90'], r['measured_tpot_p90']):>6} {_interval(r['tpot_p90_error_ci']):>15} "
              f"{r['measured_attainment']:11.2f} {r['sim_attainment']:5.2f}"
              + "".join(f"  {kind} level {v:.2f}" for kind, v in r["level"].items()))
    few = [r for r in rows if r["requests"] < 300]
    if few:
        print(f"note: {len(few)} run(s) with fewer than 300 requests: their p90 rests on a handful of requests "
              "(see the intervals); bench >= 300 per rate to resolve 10%")
    measured, simulated = goodput_of(rows, "measured_attainment"), goodput_of(rows, "sim_attainment")
    print(f"goodput over these rates: measured {measured:.2f} req/s, simulated {simulated:.2f} req/s "
          f"({_err(simulated, measured).strip()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "measured_goodput": measured, "simulated_goodput": simulated}, f, indent=1)
    return 0
