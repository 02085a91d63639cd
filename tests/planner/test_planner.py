"""The planner's parts: profile fitting and measurement, the pool simulator, `pdserve tune`,
its validation against a bench run, and the online decision rule."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest

from bench.harness.tiny_models import write_tiny_checkpoint
from bench.harness.worker_procs import REPO
from deploy.planner.online import Counters, Planner, parse_metrics, sample_lengths
from deploy.planner.profile import Profile, measure
from deploy.planner.sim_worker import StepShape
from deploy.planner.simulator import Pools, goodput, poisson_requests, simulate, summarize
from deploy.planner.step_cost import NAMES, StepCost, nnls, price
from deploy.planner.tune import goodput_of, p90_error_interval, splits, tune, validate

PRE = [0.02, 0.001, 1e-7]  # prefill step: a + b*T + c*T*(ctx + T/2)
DEC = [0.03, 0.002, 1e-6]  # decode step:  a + b*B + c*B*ctx


def _profile(kv_tokens: int = 1 << 20, **kw) -> Profile:
    return Profile("m", "bfloat16", 1, 16, 512, kv_tokens, prefill_coef=list(PRE), decode_coef=list(DEC),
                   transfer_s=0.004, **kw)


def test_one_request_costs_exactly_what_the_profile_says():
    p = _profile()
    (r,) = simulate(p, Pools(1, 1), [(1.0, 100, 4)])
    # Generate to the decode worker, its Prefill to the prefill worker, the reply back: three
    # messages; the prefill itself and the KV push between them.
    assert r.first_token == pytest.approx(1.0 + 3 * p.rpc_s + p.prefill_step_s(100, 0) + 0.004)
    steps = [p.decode_step_s(1, 101 + g) for g in range(3)]  # three more tokens, context growing
    assert r.finish == pytest.approx(r.first_token + sum(steps))
    assert r.token_times == pytest.approx([r.first_token + sum(steps[:i + 1]) for i in range(3)])
    (agg,) = simulate(p, Pools(0, 1), [(0.0, 100, 4)])  # aggregated: no transfer
    assert agg.first_token == pytest.approx(p.rpc_s + p.prefill_step_s(100, 0))


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks():
    p = _profile()
    (r,) = simulate(p, Pools(1, 1), [(0.0, 1200, 1)])
    chunks = p.prefill_step_s(512, 0) + p.prefill_step_s(512, 512) + p.prefill_step_s(176, 1024)
    assert r.first_token == pytest.approx(3 * p.rpc_s + chunks + 0.004) and r.finish == r.first_token


def test_more_workers_in_the_bottleneck_pool_help():
    p = _profile()
    prompt_heavy = poisson_requests([(1500, 2)] * 80, rate=1.5, seed=1)
    output_heavy = poisson_requests([(32, 200)] * 80, rate=1.5, seed=1)

    def p90(pools, reqs, key):
        return summarize(simulate(p, pools, reqs), 1, 1)[key]
    assert p90(Pools(2, 1), prompt_heavy, "ttft_p90") < p90(Pools(1, 2), prompt_heavy, "ttft_p90")
    assert p90(Pools(1, 2), output_heavy, "tpot_p90") < p90(Pools(2, 1), output_heavy, "tpot_p90")


def test_kv_capacity_holds_requests_back():
    reqs = [(0.0, 200, 50)] * 6
    roomy = simulate(_profile(), Pools(1, 1), reqs)
    tight = simulate(_profile(kv_tokens=600), Pools(1, 1), reqs)  # two requests fit at a time
    assert max(r.finish for r in tight) > max(r.finish for r in roomy)
    with pytest.raises(ValueError, match="KV capacity"):
        simulate(_profile(kv_tokens=100), Pools(1, 1), reqs)


def test_goodput_falls_when_steps_get_slower():
    lengths = [(200, 50)] * 60
    fast, _ = goodput(_profile(), Pools(1, 1), lengths, slo_ttft=1.0, slo_tpot=0.1)
    slow = _profile()
    slow.decode_coef = [2 * c for c in DEC]
    slower, _ = goodput(slow, Pools(1, 1), lengths, slo_ttft=1.0, slo_tpot=0.1)
    assert 0 < slower < fast


def test_fit_recovers_known_costs_and_keeps_coefficients_non_negative():
    p = _profile()
    p.prefill_points = [[t, c, p.prefill_step_s(t, c)] for t in (16, 128, 512) for c in (0, 512, 1024)]
    p.decode_points = [[b, c, p.decode_step_s(b, c)] for b in (1, 8, 32) for c in (128, 1024)]
    p.prefill_coef = p.decode_coef = [0.0, 0.0, 0.0]
    p.fit()
    assert p.prefill_coef == pytest.approx(PRE, rel=1e-6) and p.decode_coef == pytest.approx(DEC, rel=1e-6)
    assert nnls([[1, 1], [1, 2], [1, 3]], [3.0, 2.0, 1.0]) == pytest.approx([2.0, 0.0])  # slope would be < 0


def test_step_model_recovers_a_known_cost_and_reports_its_held_out_error():
    """Steps priced by a known function of the model's own form (a bend in the linears' cost
    at 64 tokens, attention terms, each decode sequence's own work) are fitted back exactly;
    the held-out error is ~0."""
    rng = random.Random(0)

    def truth(shape: StepShape) -> float:
        m = shape.num_tokens
        linears = 0.010 + 0.00002 * m if m <= 64 else 0.01128 + 0.0002 * (m - 64)  # bandwidth, then compute
        attention = 3e-7 * sum(shape.decode_contexts) + 2e-9 * sum(n * (s + n / 2) for s, n in shape.prefill_chunks)
        return (linears + attention + 0.0004 * len(shape.prefill_chunks) + 0.00003 * shape.num_sampled
                + 0.0002 * len(shape.decode_contexts))

    shapes = []
    for _ in range(300):
        decodes = tuple(rng.randrange(10, 2000) for _ in range(rng.choice([0, 1, 4, 16, 32, 64])))
        chunks = tuple((rng.randrange(0, 1500), rng.randrange(2, 400)) for _ in range(rng.choice([0, 0, 1, 2])))
        if decodes or chunks:
            shapes.append(StepShape(decodes, chunks, len(decodes) + sum(1 for _ in chunks)))
    model = StepCost.fit([(s, truth(s)) for s in shapes])
    assert model.held_out_error < 0.01 and model.points == len(shapes)
    for s in shapes[:50]:
        assert model.seconds(s) == pytest.approx(truth(s), rel=0.02)


def test_a_decode_sequence_costs_apart_from_its_token():
    """A decode batch of B and a prompt's chunk of B tokens run the same linears, but each
    decode is a sequence of its own (its attention call, its block table). Fitted on decode
    batches and chunks alone at the same token counts (as `pdserve profile` measures them),
    the model prices a small chunk at its own cost, not at the decode batch's; a profile made
    before the decode-row term (one coefficient fewer) prices as it did."""
    def truth(shape: StepShape) -> float:
        return (0.010 + 0.0004 * shape.num_tokens + 3e-7 * sum(shape.decode_contexts)
                + 0.0003 * len(shape.decode_contexts) + 0.0005 * len(shape.prefill_chunks) + 0.0001 * shape.num_sampled)

    rng = random.Random(2)
    sizes = (8, 16, 24, 32, 48, 64, 96, 128)
    shapes = [StepShape(tuple(rng.randrange(50, 900) for _ in range(b)), (), b) for b in range(1, 33) for _ in range(3)]
    shapes += [StepShape((), ((0, n),), 1) for n in sizes]  # a prompt's last chunk samples,
    shapes += [StepShape((), ((0, n),), 0) for n in sizes]  # the ones before it do not
    shapes += [StepShape(tuple(rng.randrange(50, 900) for _ in range(b)), ((0, n),), b + 1) for b in (1, 8) for n in sizes]
    model = StepCost.fit([(s, truth(s)) for s in shapes], held_out=0.0)
    assert model.coef[NAMES.index("decode_rows")] == pytest.approx(0.0003, rel=0.05)
    for n in (16, 32, 64):
        chunk, batch = StepShape((), ((0, n),), 1), StepShape((400,) * n, (), n)
        assert model.seconds(chunk) == pytest.approx(truth(chunk), rel=0.01)
        assert model.seconds(batch) == pytest.approx(truth(batch), rel=0.01)
    rows = NAMES.index("decode_rows")
    older = model.coef[:rows]  # the same fit as a profile without the term keeps it
    batch = StepShape((400,) * 8, ((0, 32),), 9)
    assert price(older, batch) == pytest.approx(model.seconds(batch) - 8 * model.coef[rows])


def test_a_knot_without_points_is_interpolated_between_its_fitted_neighbours():
    """Decodes at batches 1, 4 and 16 only, linear in the batch: the knots between them have no
    points of their own, and price as the fitted line does (none is left at 0)."""
    def truth(shape: StepShape) -> float:
        return 0.010 + 0.001 * shape.num_tokens + 2e-7 * sum(shape.decode_contexts)

    rng = random.Random(1)
    shapes = [StepShape(tuple(rng.randrange(50, 900) for _ in range(b)), (), b) for b in (1, 4, 16) for _ in range(20)]
    model = StepCost.fit([(s, truth(s)) for s in shapes], held_out=0.0)
    for batch in (2, 3, 5, 10, 15):
        shape = StepShape((300,) * batch, (), batch)
        assert model.seconds(shape) == pytest.approx(truth(shape), rel=1e-3)
    assert all(c >= 0 for c in model.coef)


def test_nnls_matches_the_constrained_optimum():
    assert nnls([[1, 0], [0, 1], [1, 1]], [2.0, -1.0, 1.0]) == pytest.approx([1.5, 0.0])  # x2 would be < 0
    assert nnls([[1, 2], [3, 4], [5, 6]], [5.0, 11.0, 17.0]) == pytest.approx([1.0, 2.0])  # the exact solution


def test_profile_measures_a_real_engine(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    grid = {"prefill": [16, 64], "long_prompt": 160, "decode_batch": [1, 4], "decode_context": [16, 48],
            "mixed_batch": [1, 6], "mixed_context": [20, 90], "mixed_beside": [3], "decode_sweep": [24],
            "chunk_tokens": [8, 24], "chunk_after": 64}
    said = []
    p = measure(str(folder), "float32", 1, grid, kv_memory_gib=0.05, max_num_batched_tokens=64, say=said.append,
                siblings=1)  # a busy worker process beside it, started first and stopped after
    assert p.siblings == 1 and any("busy sibling" in m for m in said)
    assert [pt[:2] for pt in p.prefill_points[:2]] == [[16, 0], [64, 0]]
    assert [c for _, c, _ in p.prefill_points[2:]] == [0, 64]  # the 160-token prompt: its two full chunks
    assert [pt[0] for pt in p.decode_points] == [1, 1, 4, 4] and all(s > 0 for *_, s in p.decode_points)
    assert all(c >= 0 for c in p.prefill_coef + p.decode_coef) and p.decode_step_s(4, 32) > 0
    # The step model: every mixed step a point, a held-out error, a positive price for any step.
    assert len(p.step_points) > 20 and len(p.step_coef) == len(NAMES) and all(c >= 0 for c in p.step_coef)
    assert all(math.isfinite(e) for e in p.step_error)
    assert any(points[0] and points[1] for points in p.step_points)  # decodes beside a chunk
    # The sweep: pure decode steps at every batch size from its largest down to one.
    batches = {len(decodes) for decodes, chunks, *_ in p.step_points if decodes and not chunks}
    assert set(range(1, max(batches) + 1)) <= batches and max(batches) >= 16 and any("sweep" in m for m in said)
    # Small chunks: alone, as the tail after 64 cached tokens, and beside the 3 decodes (the
    # tiny vocabulary's prompts can share a cached first block: a chunk ends at the prompt's end).
    ends = [(len(decodes), [s + n for s, n in chunks]) for decodes, chunks, *_ in p.step_points]
    for n in (8, 24):
        assert (0, [n]) in ends and (0, [64 + n]) in ends and (3, [n]) in ends
    assert p.step_s(StepShape((40, 50), ((0, 30),), 2)) > 0
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    with pytest.raises(ValueError, match="pdserve profile"):
        Profile.load(tmp_path / "tiny" / "config.json")


def test_tune_ranks_every_split_and_the_cli_prints_a_recommendation(tmp_path):
    p = _profile()
    rows = tune(p, [(300, 100)] * 60, 2.0, 0.2, workers=3)
    assert {r[0] for r in rows} == set(splits(3)) == {Pools(0, 3), Pools(1, 2), Pools(2, 1)}
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
    p.save(tmp_path / "p.json")
    out = subprocess.run([sys.executable, "-m", "deploy", "tune", "--profile", str(tmp_path / "p.json"),
                          "--workload", "fixed", "--input-len", "300", "--output-len", "100", "--workers", "3",
                          "--requests", "60", "--json", str(tmp_path / "t.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recommendation: " in out.stdout and len(json.loads((tmp_path / "t.json").read_text())) == 3


def _bench_run(rate: float, reqs) -> dict:
    """Simulated requests as one run of a `pdserve bench --json` file."""
    return {"rate": rate, "requests": [
        {"arrival_s": r.arrival, "prompt_tokens": r.prompt, "output_tokens": r.output, "ttft_s": r.ttft,
         "tpot_s": r.tpot, "status": "ok"} for r in reqs]}


def test_validation_of_a_run_the_simulator_itself_produced_has_no_error():
    p = _profile()
    runs = []
    for rate in (0.5, 4.0):
        runs.append(_bench_run(rate, simulate(p, Pools(1, 1), poisson_requests([(300, 40)] * 50, rate, seed=2))))
    rows = validate(p, Pools(1, 1), {"runs": runs}, slo_ttft=0.5, slo_tpot=0.05)
    for row in rows:
        assert row["sim_ttft_p90"] == pytest.approx(row["measured_ttft_p90"])
        assert row["sim_tpot_p90"] == pytest.approx(row["measured_tpot_p90"])
        assert row["ttft_p90_error_ci"] == pytest.approx([0.0, 0.0], abs=1e-9) and row["requests"] == 50
    assert goodput_of(rows, "measured_attainment") == goodput_of(rows, "sim_attainment")


def test_a_p90_is_one_statistic_in_the_benchmark_the_simulator_and_tune():
    """`pdserve bench`'s percentiles of a run, the simulator's of the same requests and `pdserve
    tune --validate`'s measured p90 are the same numbers, and so is attainment: one definition
    of each (deploy/planner/slo.py), so a simulated p90 and a measured one compare."""
    from bench.serving_metrics import SLO, RequestRecord, Status
    from bench.serving_metrics import summarize as bench_summary

    p = _profile()
    reqs = simulate(p, Pools(1, 1), poisson_requests([(300, 40), (40, 8)] * 12, 2.0, seed=3))
    assert len({r.ttft for r in reqs}) == len(reqs)  # distinct: a rank rule and an interpolation would differ
    records = [RequestRecord(r.prompt, r.output, r.arrival, r.ttft, r.tpot, e2e_s=r.finish - r.arrival, status=Status.OK)
               for r in reqs]
    measured = bench_summary(records, 10.0, SLO(0.5, 0.05))
    sim = summarize(reqs, 0.5, 0.05)
    (row,) = validate(p, Pools(1, 1), {"runs": [_bench_run(2.0, reqs)]}, slo_ttft=0.5, slo_tpot=0.05)
    for q in (50, 90, 99):
        assert sim[f"ttft_p{q}"] == pytest.approx(measured["ttft_s"][f"p{q}"])
        assert sim[f"tpot_p{q}"] == pytest.approx(measured["tpot_s"][f"p{q}"])
    assert row["measured_ttft_p90"] == pytest.approx(measured["ttft_s"]["p90"])
    assert row["measured_tpot_p90"] == pytest.approx(measured["tpot_s"]["p90"])
    assert 0 < sim["attainment"] < 1 and sim["attainment"] == measured["slo_attainment"] == row["measured_attainment"]


def test_p90_error_interval_brackets_the_error_and_widens_with_noise():
    rng = random.Random(1)
    measured = [rng.expovariate(1.0) for _ in range(400)]
    assert p90_error_interval([(m, 1.1 * m) for m in measured]) == pytest.approx([0.1, 0.1])
    noisy = p90_error_interval([(m, 1.1 * m * rng.uniform(0.5, 1.5)) for m in measured])
    few = p90_error_interval([(m, 1.1 * m * rng.uniform(0.5, 1.5)) for m in measured[:30]])
    assert noisy[0] < noisy[1] and few[1] - few[0] > noisy[1] - noisy[0]  # 30 requests resolve less than 400
    assert all(math.isnan(x) for x in p90_error_interval([(1.0, 1.0)] * 5))


def _window(rate: float, prompt: int, output: int, pools: Pools, p: Profile) -> tuple[Counters, float]:
    """The counters a gateway would show over 120 requests at `rate` had the profile been exact,
    and the window's length."""
    reqs = simulate(p, pools, poisson_requests([(prompt, output)] * 120, rate, seed=0))
    n = len(reqs)
    return Counters(requests=n, prompt_tokens=n * prompt, output_tokens=n * output,
                    ttft_sum=sum(r.ttft for r in reqs), ttft_count=n,
                    tpot_sum=sum(r.tpot for r in reqs), tpot_count=n), n / rate


def test_the_planner_moves_one_worker_towards_the_bottleneck_and_holds_when_balanced():
    p = _profile()
    planner = Planner(p, slo_ttft_s=2.0, slo_tpot_s=0.1)
    d = planner.decide(*_window(1.2, 1500, 2, Pools(1, 2), p), Pools(1, 2))  # prompt-heavy
    assert d.target == Pools(2, 1), d.reason
    d = planner.decide(*_window(1.5, 32, 250, Pools(2, 1), p), Pools(2, 1))  # output-heavy
    assert d.target == Pools(1, 2), d.reason
    light = planner.decide(*_window(0.05, 64, 8, Pools(1, 1), p), Pools(1, 1))  # nothing to gain: stays
    assert light.target == Pools(1, 1)
    d = planner.decide(*_window(1.0, 32, 250, Pools(1, 3), p), Pools(1, 3))
    assert abs(d.target.prefill - 1) <= 1 and d.target.prefill + d.target.decode == 4  # one step at most


def test_correction_factors_follow_the_observed_latencies():
    p = _profile()
    exact, seconds = _window(0.5, 400, 50, Pools(1, 1), p)
    assert "prefill x1.00, decode x1.00" in Planner(p, 2.0, 0.1).decide(exact, seconds, Pools(1, 1)).reason
    slow = Counters(**{**exact.__dict__, "ttft_sum": exact.ttft_sum * 100})  # far slower than predicted: clamped
    assert "prefill x4.00" in Planner(p, 2.0, 0.1).decide(slow, seconds, Pools(1, 1)).reason


def test_gateway_metrics_parse_into_counters():
    text = "\n".join([
        '# TYPE pdserve_requests counter', 'pdserve_requests_total{endpoint="chat",status="ok"} 7.0',
        'pdserve_requests_total{endpoint="completions",status="ok"} 3.0',
        'pdserve_requests_total{endpoint="chat",status="429"} 5.0',
        '# TYPE pdserve_prompt_tokens counter', 'pdserve_prompt_tokens_total 1000.0',
        '# TYPE pdserve_completion_tokens counter', 'pdserve_completion_tokens_total 250.0',
        '# TYPE pdserve_ttft_seconds histogram', 'pdserve_ttft_seconds_sum 2.5', 'pdserve_ttft_seconds_count 10.0',
        '# TYPE pdserve_tpot_seconds histogram', 'pdserve_tpot_seconds_sum 0.9', 'pdserve_tpot_seconds_count 9.0',
        '# TYPE pdserve_request_prompt_tokens histogram',
        'pdserve_request_prompt_tokens_bucket{le="64.0"} 4.0', 'pdserve_request_prompt_tokens_bucket{le="128.0"} 9.0',
        'pdserve_request_prompt_tokens_bucket{le="+Inf"} 10.0',
        '# TYPE pdserve_engine_step_seconds histogram',  # two workers' steps, summed by kind
        'pdserve_engine_step_seconds_sum{kind="decode",role="decode",worker="decode-0-a"} 2.0',
        'pdserve_engine_step_seconds_count{kind="decode",role="decode",worker="decode-0-a"} 100.0',
        'pdserve_engine_step_seconds_sum{kind="decode",role="decode",worker="decode-1-b"} 1.0',
        'pdserve_engine_step_seconds_count{kind="decode",role="decode",worker="decode-1-b"} 50.0',
        'pdserve_engine_step_seconds_sum{kind="mixed",role="decode",worker="decode-1-b"} 9.0',
        '# TYPE pdserve_engine_step_sequences histogram',
        'pdserve_engine_step_sequences_sum{kind="decode",role="decode",worker="decode-0-a"} 600.0',
        ""])
    c = parse_metrics(text)
    assert (c.requests, c.prompt_tokens, c.output_tokens) == (10, 1000, 250)
    assert (c.ttft_sum, c.ttft_count, c.tpot_sum, c.tpot_count) == (2.5, 10, 0.9, 9)
    assert c.prompt_hist == {64.0: 4.0, 128.0: 9.0, math.inf: 10.0}
    assert c.steps == {"decode": [3.0, 150.0, 600.0, 0.0]}  # mixed steps are not a decode step's price
    earlier = Counters(requests=4, prompt_hist={64.0: 1.0, 128.0: 2.0, math.inf: 2.0},
                       steps={"decode": [1.0, 50.0, 100.0, 0.0]})
    window = c.minus(earlier)
    assert window.requests == 6 and not math.isnan(c.ttft_sum)
    assert window.prompt_hist == {64.0: 3.0, 128.0: 7.0, math.inf: 8.0} and window.steps["decode"][:3] == [2, 100, 500]


def test_the_planner_replays_the_observed_lengths_scaled_to_their_means():
    import random

    hist = {64.0: 50.0, 1024.0: 60.0, 2048.0: 100.0}  # half short, half long (cumulative counts)
    drawn = sample_lengths(hist, 900.0, 2000, random.Random(0))
    assert abs(sum(drawn) / len(drawn) - 900) < 1 and min(drawn) >= 1
    assert sum(1 for x in drawn if x < 100) > 0.35 * len(drawn) and max(drawn) > 1500  # the shape kept
    assert sample_lengths({}, 37.4, 3, random.Random(0)) == [37, 37, 37]


def test_corrections_come_from_the_workers_step_times_never_from_ttft():
    from deploy.planner.sim_worker import StepShape

    p = _profile()
    exact, seconds = _window(0.5, 400, 50, Pools(1, 1), p)
    price = p.step_s(StepShape((425,) * 4, (), 4))  # what the profile says a decode step of 4 at context 425 costs
    window = dataclasses.replace(exact, ttft_sum=exact.ttft_sum * 100,  # TTFT far off: queueing, not compute
                                 steps={"decode": [2 * price * 100, 100.0, 400.0, 400.0]})
    reason = Planner(p, 2.0, 0.1).decide(window, seconds, Pools(1, 1)).reason
    assert "decode x2.00" in reason and "workers' step times" in reason and "prefill x2.00" in reason, reason


def test_calibration_recovers_the_serving_overheads_of_a_run():
    serving = _profile(ttft_overhead_s=0.2, step_overhead_s=0.03)  # what the "measured" run had
    bench = {"runs": [_bench_run(0.2, simulate(serving, Pools(1, 1), poisson_requests([(300, 40)] * 40, 0.2, seed=3)))]}
    from deploy.planner.tune import calibrate

    fitted = calibrate(_profile(), Pools(1, 1), bench, 2.0, 0.2)
    assert fitted.step_overhead_s == pytest.approx(0.03, rel=0.05)
    assert fitted.ttft_overhead_s == pytest.approx(0.2, rel=0.05)


def test_calibration_separates_a_per_sequence_overhead_across_rates():
    """Serving that costs per streamed token: a low and a high rate (small and large decode
    batches) tell the per-step and the per-sequence parts apart."""
    serving = _profile(step_overhead_s=0.01, token_overhead_s=0.004)
    runs = []
    for rate in (0.2, 3.0):
        runs.append(_bench_run(rate, simulate(serving, Pools(0, 1), poisson_requests([(100, 120)] * 80, rate, seed=4))))
    from deploy.planner.tune import calibrate

    fitted = calibrate(_profile(), Pools(0, 1), {"runs": runs}, 100.0, 10.0)  # both runs within the SLOs
    assert fitted.token_overhead_s == pytest.approx(0.004, rel=0.25)
    assert fitted.step_overhead_s == pytest.approx(0.01, abs=0.005)
