"""A worker's step log (PDSERVE_STEP_LOG, worker/step_log.py) and the fit of a deployment's
step costs from it (deploy/planner/step_fit.py): a real engine loop on a tiny model logs each step's
shape as the scheduler made it, and the fit recovers known contention (from the streamed
tokens and from the other workers' steps), loop terms and noise; the simulator shares the
cores and draws the noise as fitted."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import subprocess
import sys
import time

import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO
from deploy.planner.profile import Profile
from deploy.planner.sim_worker import StepShape
from deploy.planner.simulator import Pools, simulate
from deploy.planner.step_cost import KNOTS, price
from deploy.planner.step_fit import (LEVEL_WINDOW_S, SATURATED_ROWS, LoggedStep, LoopTerms, OthersBusy, TokenRate,
                                     fit, fit_noise, iterations, levels, read_steps)
from deploy.planner.tune import validate
from engine import LLMEngine, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from worker import step_log
from worker.loop import EngineLoop

SCHED = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)


def test_an_engine_loop_logs_each_step_as_its_scheduler_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_LOG", "1")
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(8, 64), SCHED)
    path = tmp_path / "worker.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(step_log.LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    loop = EngineLoop(engine)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        loop.call(lambda: engine.add_request("a", list(range(3, 23)), params))  # 20 tokens: one chunk
        loop.call(lambda: engine.add_request("b", list(range(30, 70)), params))  # 40: two chunks at 32 a step
        deadline = time.monotonic() + 60
        while loop.call(engine.has_unfinished):
            assert time.monotonic() < deadline, "the requests did not finish"
            time.sleep(0.01)
    finally:
        loop.stop()
        logger.removeHandler(handler)
        handler.close()
    steps = list(read_steps([path]))
    assert steps[0].shape.prefill_chunks[0] == (0, 20) and steps[0].gap_s is None
    chunks = [c for s in steps for c in s.shape.prefill_chunks]
    assert sum(n for _, n in chunks) == 60  # every prompt token once, in chunks of at most 32 a step
    assert all(s.shape.num_tokens <= 32 for s in steps)
    assert sum(s.shape.num_sampled for s in steps) == 12  # six tokens each
    decodes = [c for s in steps for c in s.shape.decode_contexts]
    assert sorted(decodes)[:2] == [21, 22] and max(decodes) == 45  # contexts as the runner sees them
    assert all(0 < s.engine_s <= s.busy_s for s in steps)


def _coef() -> list[float]:
    coef = [0.005 + 2e-5 * k for k in KNOTS]  # a constant and a cost per token through the linears
    return coef + [1e-6, 0.0, 0.0, 0.0]  # and the KV read per context token


def test_the_fit_recovers_a_deployments_contention_and_loop_terms():
    """Steps slower by 1.4x, and by 0.2 more per 100 tokens/s streamed (a light phase, then a
    heavy one), each iteration 2 ms + 0.5 ms per sampled row longer, 1 ms between steps."""
    coef, steps, t = _coef(), [], 0.0
    for i in range(120):
        batch = 1 if i < 60 else 8
        shape = StepShape(tuple(100 + 10 * j for j in range(batch)), ((0, 64),) if i % 5 == 0 else (),
                          batch + (i % 5 == 0))
        rate = TokenRate(steps).at(t)
        engine = price(coef, shape) * (1.4 + 0.002 * rate)
        busy = engine + 0.002 + 0.0005 * shape.num_sampled
        steps.append(LoggedStep(t, "decode d0", shape, engine, busy, None if i == 0 else 0.001))
        t += busy + 0.001
    assert TokenRate(steps).at(t) > 5 * TokenRate(steps[:60]).at(steps[59].t)  # two different loads
    terms = fit(coef, steps)["aggregated"]  # no prefill worker among them
    assert terms.scale == pytest.approx(1.4, rel=1e-3) and terms.per_token_rate == pytest.approx(0.002, rel=1e-2)
    assert terms.fixed_s == pytest.approx(0.003, abs=1e-4)  # the loop's own 2 ms and the 1 ms before each next step
    assert terms.per_sampled_s == pytest.approx(0.0005, rel=0.05)
    assert terms.error < 0.01
    assert len(list(iterations(steps))) == 120


def test_a_profile_with_loop_terms_prices_each_role_by_them():
    p = Profile("m", "float32", 1, 16, 512, 1 << 16, step_coef=_coef())
    shape = StepShape((200, 300), (), 2)
    assert p.step_s(shape, "prefill") == pytest.approx(price(p.step_coef, shape))
    p.loop_terms = {"decode": [2.0, 0.001, 0.0005, 0.01]}
    assert p.step_s(shape, "decode") == pytest.approx(2 * price(p.step_coef, shape) + 0.002)
    assert p.step_s(shape, "decode", 50.0) == pytest.approx(2.5 * price(p.step_coef, shape) + 0.002)
    assert p.step_s(shape, "prefill") == pytest.approx(price(p.step_coef, shape))  # no terms for that kind
    slow = simulate(p, Pools(1, 1), [(0.0, 64, 16)])[0]
    p.loop_terms["prefill"] = [3.0, 0.0, 0.0]  # a prefill worker three times slower: a later first token
    assert simulate(p, Pools(1, 1), [(0.0, 64, 16)])[0].ttft > slow.ttft
    alone = simulate(p, Pools(0, 1), [(0.0, 64, 16)])[0]
    p.loop_terms["aggregated"] = [2.0, 0.0, 0.0]  # an aggregated worker's terms are its own
    assert simulate(p, Pools(0, 1), [(0.0, 64, 16)])[0].finish > alone.finish


def test_the_fit_recovers_how_much_slower_a_step_runs_beside_a_busy_worker():
    """Prefill worker B steps for 1 s, rests for 1 s, and so on; decode worker A's steps cost
    1.1x their price beside an idle B and 1.1 + 0.3 = 1.4x beside a busy one, plus 0.2 ms per
    sampled row."""
    coef, steps = _coef(), []
    for k in range(20):  # B: 0.1 s steps through every even second
        steps += [LoggedStep(2 * k + 0.1 * i, "prefill b", StepShape((), ((0, 64),), 1), 0.1, 0.1, 0.0)
                  for i in range(10)]
    t = 0.0
    while t < 40:
        shape = StepShape(tuple(100 for _ in range(1 + int(t) % 4)), (), 1 + int(t) % 4)
        beside_busy = int(t) % 2 == 0
        engine = price(coef, shape) * (1.4 if beside_busy else 1.1) + 0.0002 * shape.num_sampled
        if int(t) == int(t + engine):  # a step within one second: all beside busy, or all beside idle
            steps.append(LoggedStep(t, "decode a", shape, engine, engine, 0.0))
        t += engine
    busy = OthersBusy(steps)
    a_steps = [s for s in steps if s.process == "decode a"]
    assert {round(busy.over(s.process, s.t, s.t + s.busy_s), 6) for s in a_steps} == {0.0, 1.0}
    terms = fit(coef, steps)["decode"]
    assert terms.per_busy == pytest.approx(0.3, abs=0.02) and terms.per_row_s == pytest.approx(0.0002, rel=0.1)
    assert terms.scale == pytest.approx(1.1, abs=0.02)


def test_the_per_row_cost_stops_at_saturation_and_the_loop_is_fitted_on_its_measured_time():
    """Batches of 1 to 40: the engine 1.2x its price + 0.3 ms per row up to SATURATED_ROWS, each
    step off by up to 10% more that no term explains; the loop 1 ms + 0.2 ms per row exactly.
    The loop terms come back exact (the engine's misses stay out of them), the row term as
    generated, and a step of 40 rows costs the engine no more rows than one of SATURATED_ROWS."""
    coef, steps, t, rng = _coef(), [], 0.0, random.Random(3)
    for i in range(400):
        batch = 1 + i % 40
        shape = StepShape(tuple(200 for _ in range(batch)), (), batch)
        engine = (price(coef, shape) * 1.2 + 0.0003 * min(batch, SATURATED_ROWS)) * rng.uniform(0.9, 1.1)
        steps.append(LoggedStep(t, "decode d0", shape, engine, engine + 0.001 + 0.0002 * batch, 0.0))
        t += engine + 0.002
    terms = fit(coef, steps)["aggregated"]
    assert terms.fixed_s == pytest.approx(0.001, rel=1e-6) and terms.per_sampled_s == pytest.approx(0.0002, rel=1e-6)
    assert terms.scale == pytest.approx(1.2, rel=0.05) and terms.per_row_s == pytest.approx(0.0003, rel=0.3)
    price_of = price(coef, StepShape((200,) * 8, (), 8))
    assert terms.engine_s(price_of, 40) == terms.engine_s(price_of, SATURATED_ROWS)  # the same price, more rows
    assert terms.engine_s(price_of, SATURATED_ROWS) > terms.engine_s(price_of, 1)


def test_the_hosts_drift_between_minutes_is_a_level_not_a_contention_term():
    """Three minutes whose steps run at 1.0x, 1.2x and 1.4x their price while the streamed
    token rate rises with them (batches of 1-2, then 4-5, then 8-9 rows), and no step costs
    more for the tokens streamed beside it within a minute: the drift is the host's, so the
    fit gives no token-rate term (a fit with one level for the log would read the drift as
    one) and a scale between the minutes' levels."""
    coef, steps, t = _coef(), [], 0.0
    while t < 3 * LEVEL_WINDOW_S:
        minute = int(t // LEVEL_WINDOW_S)
        batch = (1, 4, 8)[minute] + int(t // 5) % 2  # within a minute the rate moves too
        shape = StepShape(tuple(100 for _ in range(batch)), (), batch)
        engine = price(coef, shape) * (1.0, 1.2, 1.4)[minute]
        steps.append(LoggedStep(t, "decode d0", shape, engine, engine, 0.0))
        t += engine
    rate = TokenRate(steps)
    assert rate.at(2.5 * LEVEL_WINDOW_S) > 2.5 * rate.at(0.5 * LEVEL_WINDOW_S)
    terms = fit(coef, steps)["aggregated"]
    assert terms.per_token_rate == pytest.approx(0.0, abs=1e-5)
    assert 1.05 < terms.scale < 1.35
    spans = [levels(coef, {"aggregated": terms.as_list()}, steps, m * LEVEL_WINDOW_S, (m + 1) * LEVEL_WINDOW_S)
             for m in range(3)]  # each minute's own level, given the fitted terms
    assert [s["aggregated"] for s in spans] == pytest.approx([1.0, 1.2, 1.4], rel=1e-3)


def test_validation_at_the_level_a_run_was_measured_at_reproduces_it(tmp_path):
    """A run measured on a host 1.3x slower than the profile's terms: validated at the profile's
    level its p90s are off; at the level its own step log shows, they come back exactly."""
    p = Profile("m", "float32", 1, 16, 512, 1 << 16, step_coef=_coef())
    p.loop_terms = {"aggregated": LoopTerms(1.0, 0.001, 0.0002).as_list()}
    slower = dataclasses.replace(p, loop_terms={"aggregated": LoopTerms(1.3, 0.001, 0.0002).as_list()})
    measured = simulate(slower, Pools(0, 1), [(0.2 * i, 64 + 8 * (i % 5), 20) for i in range(60)])
    start = 1_000_000.0  # wall clock of the run's time zero
    run = {"rate": 5.0, "started_at": start, "duration_s": max(r.finish for r in measured), "requests": [
        {"arrival_s": r.arrival, "prompt_tokens": r.prompt, "output_tokens": r.output, "ttft_s": r.ttft,
         "tpot_s": r.tpot, "status": "ok"} for r in measured]}
    log = [LoggedStep(start + 0.05 * i, "decode d0", shape, 1.3 * price(_coef(), shape), 1.3 * price(_coef(), shape),
                      0.0)
           for i, b in enumerate([1, 3, 6] * 40) for shape in [StepShape((100,) * b, (), b)]]
    log.append(LoggedStep(start - 500.0, "decode d0", StepShape((100,), (), 1), 9.0, 9.0, 0.0))  # another run's
    plain = validate(p, Pools(0, 1), {"runs": [run]}, 10.0, 1.0)[0]
    assert plain["sim_tpot_p90"] < 0.9 * plain["measured_tpot_p90"] and plain["level"] == {}
    leveled = validate(p, Pools(0, 1), {"runs": [run]}, 10.0, 1.0, level_steps=log)[0]
    assert leveled["level"]["aggregated"] == pytest.approx(1.3, rel=1e-6)
    assert leveled["sim_tpot_p90"] == pytest.approx(leveled["measured_tpot_p90"], rel=1e-6)
    assert leveled["sim_ttft_p90"] == pytest.approx(leveled["measured_ttft_p90"], rel=1e-6)
    with pytest.raises(ValueError, match="no start time"):
        validate(p, Pools(0, 1), {"runs": [{**run, "started_at": None}]}, 10.0, 1.0, level_steps=log)
    with pytest.raises(ValueError, match="no logged steps"):
        validate(p, Pools(0, 1), {"runs": [{**run, "started_at": start + 1e4}]}, 10.0, 1.0, level_steps=log)

    # The same through the CLI, the log as the workers write it.
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "decode-0.log").write_text("".join(
        "2026-12-05 00:00:00,000 INFO pdserve.step: " + json.dumps(
            {"t": s.t, "proc": s.process, "decodes": list(s.shape.decode_contexts), "chunks": [], "sampled":
             s.shape.num_sampled, "engine_s": s.engine_s, "busy_s": s.busy_s, "gap_s": s.gap_s}) + "\n" for s in log))
    p.save(tmp_path / "p.json")
    (tmp_path / "b.json").write_text(json.dumps({"runs": [run]}))
    cli = [sys.executable, "-m", "deploy", "tune", "--profile", str(tmp_path / "p.json"), "--prefill", "0",
           "--decode", "1", "--slo-ttft", "10", "--slo-tpot", "1"]
    out = subprocess.run(cli + ["--validate", str(tmp_path / "b.json"), "--level", str(tmp_path / "logs")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "aggregated level 1.30" in out.stdout
    out = subprocess.run(cli + ["--level", str(tmp_path / "logs")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "give --validate too" in out.stderr


def test_the_noise_fit_recovers_a_stray_that_lasts():
    """An Ornstein-Uhlenbeck process in log(measured / predicted), sd 0.2, time constant 1 s,
    sampled every 20 ms for 20 minutes: its sd and time constant come back."""
    rng, z, run = random.Random(1), 0.0, []
    keep = math.exp(-0.02 / 1.0)
    for i in range(60_000):
        z = z * keep + 0.2 * math.sqrt(1 - keep * keep) * rng.gauss(0.0, 1.0)
        run.append((i * 0.02, 0.02 * math.exp(z), 0.02))
    sd, tau = fit_noise([run])
    assert sd == pytest.approx(0.2, rel=0.15) and tau == pytest.approx(1.0, rel=0.3)
    assert fit_noise([[(i * 0.02, 0.02, 0.02) for i in range(500)]]) == (0.0, 0.0)  # no stray, no noise


def test_the_simulator_slows_steps_while_another_worker_steps():
    """Two requests at once on two aggregated workers whose steps cost twice as much beside a
    busy worker: each takes about twice as long as alone; beside an idle worker, as alone."""
    p = Profile("m", "float32", 1, 16, 512, 1 << 16, step_coef=_coef())
    p.loop_terms = {"aggregated": LoopTerms(1.0, 0.0, 0.0, per_busy=1.0).as_list()}
    alone = simulate(p, Pools(0, 2), [(0.0, 64, 33)])[0]
    both = simulate(p, Pools(0, 2), [(0.0, 64, 33), (0.0, 64, 33)])
    assert both[0].finish == pytest.approx(both[1].finish, rel=0.05)
    assert both[0].tpot == pytest.approx(2 * alone.tpot, rel=0.05)
    staggered = simulate(p, Pools(0, 2), [(0.0, 64, 33), (100.0, 64, 33)])
    assert staggered[1].tpot == pytest.approx(alone.tpot, rel=1e-6)  # the first one long gone


def test_the_simulator_draws_each_workers_noise_from_its_seed_with_the_fitted_mean():
    p = Profile("m", "float32", 1, 16, 512, 1 << 16, step_coef=_coef())
    p.loop_terms = {"aggregated": LoopTerms(1.0, 0.0, 0.0).as_list()}
    requests = [(0.5 * i, 64, 65) for i in range(200)]
    quiet = simulate(p, Pools(0, 2), requests)
    p.loop_terms = {"aggregated": LoopTerms(1.0, 0.0, 0.0, noise_sd=0.3, noise_s=0.5).as_list()}
    assert p.noisy
    one, again, other = (simulate(p, Pools(0, 2), requests, seed=s) for s in (1, 1, 2))
    assert [r.finish for r in one] == [r.finish for r in again]  # a seed replays exactly
    assert [r.finish for r in one] != [r.finish for r in other]
    tpots = [r.tpot for r in one + other]
    mean_quiet = sum(r.tpot for r in quiet) / len(quiet)
    assert sum(tpots) / len(tpots) == pytest.approx(mean_quiet, rel=0.1)  # the noise's mean factor is 1
    spread = sorted(tpots)
    assert spread[int(0.9 * len(spread))] > 1.2 * spread[int(0.1 * len(spread))]  # requests now differ
