"""The serving benchmark (bench/serving.py): workload sampling, arrivals and the metrics on
hand-made request records, the client on canned HTTP answers, and one run against a real
gateway over a real decode worker (SmolLM2)."""

from __future__ import annotations

import json
import math
import random
import statistics

import httpx
import pytest

from bench import serving, serving_cli
from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import start_workers, wait_idle
from bench.serving import (SLO, Load, Plan, RequestRecord, Run, Status, Target, goodput, next_probe, percentile,
                           summarize)
from deploy.planner.workload import (LONG_INPUT, LONG_OUTPUT, Request, poisson_arrivals, requests_from_lengths,
                                     sample_workload, sharegpt_requests)


class CharTokenizer:
    """A stand-in tokenizer: one token per character."""

    vocab_size = 50000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


# ---- workloads and arrivals -----------------------------------------------------------------

def test_sharegpt_lengths_have_the_documented_means_and_caps():
    pairs = sample_workload("sharegpt", 20000, seed=1)
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert 225 <= statistics.mean(prompts) <= 275 and 180 <= statistics.mean(outputs) <= 220
    assert statistics.median(prompts) < statistics.mean(prompts)  # heavy right tail
    assert min(prompts) >= 4 and max(prompts) == 1024 and min(outputs) >= 4 and max(outputs) == 512
    capped = sample_workload("sharegpt", 2000, seed=1, max_input=300, max_output=50)
    assert max(p for p, _ in capped) == 300 and max(o for _, o in capped) == 50


def test_sampling_is_determined_by_the_seed():
    for name in ("sharegpt", "long-prompt"):
        assert sample_workload(name, 500, seed=3) == sample_workload(name, 500, seed=3)
        assert sample_workload(name, 500, seed=3) != sample_workload(name, 500, seed=4)
    assert poisson_arrivals(2.0, 100, seed=3) == poisson_arrivals(2.0, 100, seed=3)
    assert poisson_arrivals(2.0, 100, seed=3) != poisson_arrivals(2.0, 100, seed=4)


def test_sharegpt_requests_use_the_same_lengths_as_sample_workload():
    reqs = sharegpt_requests(CharTokenizer(), num_requests=50, seed=7)
    assert [(len(r.prompt_token_ids), r.output_len) for r in reqs] == sample_workload("sharegpt", 50, seed=7)


def test_fixed_and_long_prompt_mix():
    assert sample_workload("fixed", 5, seed=0, input_len=32, output_len=8) == [(32, 8)] * 5
    pairs = sample_workload("long-prompt", 20000, seed=2)
    long = [(p, o) for p, o in pairs if p >= LONG_INPUT[0]]
    assert 0.18 <= len(long) / len(pairs) <= 0.22
    assert all(LONG_INPUT[0] <= p <= LONG_INPUT[1] and LONG_OUTPUT[0] <= o <= LONG_OUTPUT[1] for p, o in long)
    short = [(p, o) for p, o in pairs if p < LONG_INPUT[0]]
    assert max(p for p, _ in short) <= 512 and max(o for _, o in short) <= 256
    assert len(sample_workload("long-prompt", 2000, seed=2, long_fraction=0.0)) == 2000


def test_unknown_workloads_and_params_say_what_is_allowed():
    with pytest.raises(ValueError, match="sharegpt, fixed, long-prompt"):
        sample_workload("chat", 3, seed=0)
    with pytest.raises(ValueError, match="input_len, output_len"):
        sample_workload("fixed", 3, seed=0, max_input=5)


def test_poisson_arrivals_have_exponential_gaps_at_the_rate():
    times = poisson_arrivals(5.0, 20000, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, seed=0)


def test_prompts_have_exact_lengths_and_share_no_prefix_block_across_seeds():
    lengths = sample_workload("sharegpt", 200, seed=0)
    a = requests_from_lengths(CharTokenizer(), lengths, seed=1, vocab_size=50000)
    b = requests_from_lengths(CharTokenizer(), lengths, seed=2, vocab_size=50000)
    assert [(len(r.prompt_token_ids), r.output_len) for r in a] == lengths
    blocks = {tuple(r.prompt_token_ids[:16]) for r in a if len(r.prompt_token_ids) >= 16}
    assert not blocks & {tuple(r.prompt_token_ids[:16]) for r in b}
    assert len(blocks) == sum(len(r.prompt_token_ids) >= 16 for r in a)  # none shared within a run


# ---- metrics on hand-made records -----------------------------------------------------------

def ok(ttft: float, tpot: float | None, out: int = 8, itl: list[float] | None = None) -> RequestRecord:
    e2e = ttft + (tpot or 0.0) * (out - 1)
    return RequestRecord(32, out, 0.0, ttft, tpot, itl or [], e2e, Status.OK)


def test_percentile_matches_linear_interpolation():
    rng = random.Random(0)
    values = [rng.random() for _ in range(101)]
    s = sorted(values)
    assert percentile(values, 50) == s[50] and percentile(values, 0) == s[0] and percentile(values, 100) == s[-1]
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summary_counts_attainment_over_every_request_sent():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        ok(0.5, 0.05, itl=[0.05] * 7),  # good
        ok(2.0, 0.05, itl=[0.05] * 7),  # TTFT miss
        ok(0.5, 0.2, itl=[0.2] * 7),  # TPOT miss
        ok(0.5, None, out=1),  # one token: no TPOT to miss, good
        RequestRecord(32, status=Status.FAILED, error="HTTP 500: boom"),
        RequestRecord(32, status=Status.REJECTED, error="HTTP 429: overloaded"),
    ]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert (s["total"], s["ok"], s["failed"], s["rejected"], s["good"]) == (6, 4, 1, 1, 2)
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == (8 * 3 + 1) / 2.0
    assert s["ttft_s"]["p50"] == 0.5 and s["ttft_s"]["p99"] == pytest.approx(1.955)
    assert s["tpot_s"]["p50"] == 0.05  # over the three requests that have one
    assert s["itl_s"]["p90"] == pytest.approx(0.2) and s["itl_s"]["p50"] == pytest.approx(0.05)


def test_summary_of_only_failed_or_no_requests():
    slo = SLO(1.0, 0.1)
    s = summarize([RequestRecord(32, status=Status.FAILED), RequestRecord(32, status=Status.REJECTED)], 1.0, slo)
    assert (s["ok"], s["good"], s["slo_attainment"], s["ttft_s"]["p90"], s["itl_s"]["mean"]) == (0, 0, 0.0, None, None)
    assert summarize([], 0.0, slo)["slo_attainment"] == 0.0
    json.dumps(s, allow_nan=False)


def run_at(rate: float | None, attainment: float, concurrency: int | None = None, rps: float = 1.0) -> Run:
    return Run(Load(rate=rate, concurrency=concurrency), 10.0,
               {"slo_attainment": attainment, "request_throughput": rps}, [])


def test_goodput_is_the_highest_passing_rate():
    assert goodput([run_at(1, 1.0), run_at(2, 0.95), run_at(4, 0.5)]) == 2
    assert goodput([run_at(1, 0.8), run_at(2, 0.9)]) == 2  # not monotone: still the highest passing
    assert goodput([run_at(1, 0.89), run_at(2, 0.0)]) is None  # no passing rate
    assert goodput([]) is None
    closed = [run_at(None, 1.0, 1, rps=0.8), run_at(None, 0.95, 4, rps=2.5), run_at(None, 0.2, 8, rps=3.0)]
    assert goodput(closed) == 2.5  # throughput at the highest passing concurrency


def test_next_probe_bisects_between_last_pass_and_first_fail():
    assert next_probe([run_at(1, 1.0), run_at(2, 0.95), run_at(4, 0.5)]) == 3
    assert next_probe([run_at(1, 0.5), run_at(2, 0.1)]) == 0.5  # nothing passed: between 0 and the first rate
    assert next_probe([run_at(1, 1.0), run_at(2, 1.0)]) is None  # nothing failed
    assert next_probe([run_at(1.0, 1.0), run_at(1.04, 0.5)]) is None  # close enough


def test_sweep_with_goodput_search_is_bounded(monkeypatch):
    capacity = 2.7  # a fake server: every request good below this rate, none above
    calls = []

    def fake_run_one(target, plan, load, tokenizer, index):
        calls.append((load.rate, index))
        return run_at(load.rate, 1.0 if load.rate <= capacity else 0.0)

    monkeypatch.setattr(serving, "run_one", fake_run_one)
    plan = Plan("fixed", {}, 10, None, SLO(1, 1), pause_s=0.0)
    runs = serving.sweep(None, plan, [Load(rate=r) for r in (1, 2, 4)], None, search_steps=3)
    assert [r for r, _ in calls] == [1, 2, 4, 3, 2.5, 2.75]
    assert [i for _, i in calls] == list(range(6))  # fresh prompts every run
    assert [r.load.rate for r in runs] == sorted(r for r, _ in calls) and goodput(runs) == 2.5


def test_cli_checks_its_arguments():
    args = serving_cli.parse(["--sweep", "0.5,1", "--workload", "fixed", "--input-len", "16"])
    assert [lo.rate for lo in args.loads] == [0.5, 1.0] and args.num_requests == 100
    assert serving.plan_of(args).params == {"input_len": 16}
    assert [lo.concurrency for lo in serving_cli.parse(["--concurrency", "1", "4"]).loads] == [1, 4]
    for bad in (["--input-len", "16"], ["--rate", "0"], ["--sweep", "1,inf"], ["--compare"],
                ["--rate", "1", "--concurrency", "2"], ["--num-requests", "0"]):
        with pytest.raises(SystemExit):
            serving_cli.parse(bad)


def test_json_and_table_of_a_run(tmp_path):
    slo = SLO(1.0, 0.1)
    records = [ok(0.5, 0.05, itl=[0.05] * 7), RequestRecord(32, status=Status.REJECTED, error="HTTP 429: busy")]
    runs = [Run(Load(rate=1.0), 3.0, summarize(records, 3.0, slo), records)]
    out = json.loads(json.dumps(serving.result_json({"model": "m"}, runs), allow_nan=False))
    assert out["goodput_rps"] is None and out["runs"][0]["rate"] == 1.0
    req = out["runs"][0]["requests"][1]
    assert set(req) == {"prompt_tokens", "output_tokens", "arrival_s", "ttft_s", "tpot_s", "itl_s", "e2e_s",
                        "status", "error"} and req["status"] == "rejected"
    text = serving.table(runs, slo)
    assert "50%" in text and "goodput: none" in text
    from bench.plots import plot_runs

    paths = plot_runs({"a": runs, "b": runs}, slo, str(tmp_path / "p"))
    assert all(p.stat().st_size > 1000 for p in paths)


# ---- the client on canned answers -----------------------------------------------------------

def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


@pytest.mark.parametrize("status,body,expect,error", [
    (200, sse(chunk("a"), chunk(""), chunk("b"), chunk("c"), {"choices": [], "usage": {"completion_tokens": 4}},
              "[DONE]"), Status.OK, ""),
    (429, b'{"error": {"message": "overloaded: queue full"}}', Status.REJECTED, "HTTP 429: overloaded: queue full"),
    (500, b"Internal Server Error", Status.FAILED, "HTTP 500: Internal Server Error"),
    (200, sse(chunk("a"), {"error": {"message": "decode worker failed"}}), Status.FAILED, "decode worker failed"),
    (200, sse(chunk("a"), chunk("b")), Status.FAILED, "stream ended before [DONE]"),
    (200, sse(chunk("a"), "not json"), Status.FAILED, "JSONDecodeError"),
])
def test_client_records_status_timings_and_errors(status, body, expect, error):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestRecord:
        rec = RequestRecord(3)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await Target("http://x", "m", api_key="k").send(client, Request([1, 2, 3], 4), rec)
        return rec

    import asyncio

    rec = asyncio.run(go())
    assert seen[0] == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}
    assert rec.status is expect and error in rec.error
    if expect is Status.OK:
        assert rec.output_tokens == 4 and len(rec.itl_s) == 2 and 0 <= rec.ttft_s <= rec.e2e_s
        assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 3)


# ---- end to end -----------------------------------------------------------------------------

def test_bench_against_a_real_gateway(smollm2_dir, tmp_path):
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256", "--no-transfer"], {})],
                              smollm2_dir, tmp_path, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [], tmp_path / "gateway.log") as url:
            out = tmp_path / "bench.json"
            code = serving_cli.main(["--url", url, "--model", "smollm2", "--workload", "fixed", "--input-len", "32",
                                     "--output-len", "8", "--rate", "4", "--num-requests", "6", "--pause", "0",
                                     "--slo-ttft", "5", "--slo-tpot", "1", "--json", str(out)])
        assert code == 0
        result = json.loads(out.read_text())
        assert result["config"]["workload"] == "fixed" and len(result["runs"]) == 1
        run = result["runs"][0]
        assert run["rate"] == 4.0 and run["summary"]["ok"] == 6
        for r in run["requests"]:
            assert (r["status"], r["error"], r["prompt_tokens"], r["output_tokens"]) == ("ok", "", 32, 8), r
            assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) == 7 and r["tpot_s"] > 0
        assert 0.0 <= run["summary"]["slo_attainment"] <= 1.0
        assert result["goodput_rps"] in (None, 4.0)
        stats = wait_idle(decode)
        assert stats.running_requests == 0 and stats.free_blocks == stats.total_blocks  # nothing leaked
    finally:
        decode.stop()


def test_compare_prints_both_deployments_and_the_goodput_ratio():
    from bench.compare import ratio, serve_command, side_by_side

    def runs(*attainments):
        return [Run(Load(rate=x), 1.0, summarize([ok(0.5, 0.05)] if a else [RequestRecord(1)], 1.0, SLO(1, 1)), [])
                for x, a in zip((0.5, 1.0, 2.0), attainments)]

    results = {"aggregated 0P+2D": runs(True, False, False), "disaggregated 1P+1D": runs(True, True, False)}
    text = side_by_side(results)
    assert ratio(results) == 2.0 and "2.00x" in text and text.count("100%") == 3 and text.count("0%") == 6
    assert ratio({"a": runs(False), "b": runs(True)}) is None
    cmd = serve_command("smollm2", "float32", 0, 2, 8001, 2)
    assert cmd[1:] == ["-m", "deploy", "serve", "--model", "smollm2", "--dtype", "float32", "--prefill", "0",
                       "--decode", "2", "--host", "127.0.0.1", "--port", "8001", "--num-cpus", "2"]
