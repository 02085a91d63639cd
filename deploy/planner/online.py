"""The online planner: from the load the gateway observed, which split of the same workers
would serve it best, and one step towards it.

Each window (the controller's `planner.interval_s`) reads the one scrape of the system
(the gateway's and every worker's metrics): finished requests, the histograms of their
prompt and output lengths, the sums behind mean TTFT and TPOT, and the workers' own step
times. The profile's costs are first corrected from the step times the workers measured
(observed mean decode step / the profile's price of a decode step of the observed mean
batch, and alike for prefill steps, each clamped to [0.5, 4]): never from TTFT, whose gap
to a prediction is mostly queueing, which the simulator itself models (NVIDIA Dynamo's
planner caps its TTFT correction for that reason). Where the workers report no step times
the older rule applies: observed / predicted mean TTFT and TPOT. Then every split of the
same total with at least one worker per pool is simulated at the observed rate with
lengths drawn from the observed histograms (scaled to the observed means) and scored by
SLO attainment, then by headroom (the worse of p90 TTFT / SLO and p90 TPOT / SLO). A split
that beats the current one by a clear margin is the target; the controller moves one
worker per decision and waits out a cool-down, draining before it removes. Each decision
says the numbers behind it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import ssl
import statistics
import urllib.request
from dataclasses import dataclass, field

from deploy.planner.pools import Pools, splits
from deploy.planner.profile import Profile
from deploy.planner.simulator import poisson_requests, simulate, summarize
from deploy.planner.slo import percentile

CLAMP = (0.5, 4.0)
MARGIN = 0.1  # a better split must cut the headroom ratio by 10% (or raise attainment by 5 points)

_COUNTERS = {  # Prometheus sample name -> window field
    "pdserve_prompt_tokens_total": "prompt_tokens",
    "pdserve_completion_tokens_total": "output_tokens",
    "pdserve_ttft_seconds_sum": "ttft_sum",
    "pdserve_ttft_seconds_count": "ttft_count",
    "pdserve_tpot_seconds_sum": "tpot_sum",
    "pdserve_tpot_seconds_count": "tpot_count",
}


@dataclass
class Counters:
    """The gateway's cumulative counters at one moment."""

    requests: float = 0.0  # finished without error
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    # Cumulative bucket counts by upper bound (math.inf last) of each finished request's lengths.
    prompt_hist: dict[float, float] = field(default_factory=dict)
    output_hist: dict[float, float] = field(default_factory=dict)
    # The workers' engine steps by kind ("decode", "prefill"): [seconds, steps, sequences, tokens] summed.
    steps: dict[str, list[float]] = field(default_factory=dict)

    def minus(self, earlier: Counters) -> Counters:
        def sub(a: dict, b: dict) -> dict:
            return {k: (v - b[k] if not isinstance(v, list) else [x - y for x, y in zip(v, b[k])]) if k in b else v
                    for k, v in a.items()}
        scalars = [getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)
                   if f.name not in ("prompt_hist", "output_hist", "steps")]
        return Counters(*scalars, sub(self.prompt_hist, earlier.prompt_hist),
                        sub(self.output_hist, earlier.output_hist), sub(self.steps, earlier.steps))


def parse_metrics(text: str) -> Counters:
    from prometheus_client.parser import text_string_to_metric_families

    c = Counters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_requests_total" and sample.labels.get("status") == "ok":
                c.requests += sample.value
            elif sample.name in _COUNTERS:
                setattr(c, _COUNTERS[sample.name], getattr(c, _COUNTERS[sample.name]) + sample.value)
            elif sample.name in _LENGTHS:
                hist = getattr(c, _LENGTHS[sample.name])
                le = float(sample.labels["le"])
                hist[le] = hist.get(le, 0.0) + sample.value
            elif sample.name in _STEPS and sample.labels.get("kind") in ("decode", "prefill"):
                sums = c.steps.setdefault(sample.labels["kind"], [0.0, 0.0, 0.0, 0.0])
                sums[_STEPS[sample.name]] += sample.value
    return c


_LENGTHS = {"pdserve_request_prompt_tokens_bucket": "prompt_hist",
            "pdserve_request_completion_tokens_bucket": "output_hist"}
_STEPS = {"pdserve_engine_step_seconds_sum": 0, "pdserve_engine_step_seconds_count": 1,
          "pdserve_engine_step_sequences_sum": 2, "pdserve_engine_step_tokens_sum": 3}


def sample_lengths(hist: dict[float, float], mean: float, n: int, rng: random.Random) -> list[int]:
    """n lengths drawn from a window's histogram (uniform within a bucket; the open last one
    up to twice its lower bound), scaled so that their mean is the observed one: the
    histogram gives the shape, the exact token sums the level. No histogram: the mean."""
    bounds = sorted(hist)
    counts, lower, prev = [], [], 0.0
    for i, le in enumerate(bounds):
        counts.append(max(0.0, hist[le] - prev))
        lower.append(bounds[i - 1] if i else 0.0)
        prev = hist[le]
    if sum(counts) <= 0:
        return [max(1, round(mean))] * n
    drawn = []
    for _ in range(n):
        i = rng.choices(range(len(bounds)), weights=counts)[0]
        hi = bounds[i] if math.isfinite(bounds[i]) else 2 * max(1.0, lower[i])
        drawn.append(rng.uniform(lower[i], hi))
    scale = mean / statistics.fmean(drawn) if statistics.fmean(drawn) > 0 else 1.0
    return [max(1, round(x * scale)) for x in drawn]


def scrape(gateway_url: str, timeout_s: float = 5.0, context: ssl.SSLContext | None = None) -> Counters:
    """The gateway's counters (`context`: how to check a TLS gateway)."""
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=timeout_s, context=context) as resp:
        return parse_metrics(resp.read().decode())


@dataclass
class Decision:
    target: Pools  # one step from the current split (or the current split: no change)
    best: Pools
    reason: str


class Planner:
    def __init__(self, profile: Profile, slo_ttft_s: float, slo_tpot_s: float, requests: int = 120, seed: int = 0):
        self.profile, self.slo_ttft, self.slo_tpot = profile, slo_ttft_s, slo_tpot_s
        self.requests, self.seed = requests, seed

    def decide(self, window: Counters, seconds: float, current: Pools) -> Decision:
        n = window.requests
        rate = n / seconds
        prompt = window.prompt_tokens / n
        output = window.output_tokens / n
        rng = random.Random(self.seed)
        lengths = list(zip(sample_lengths(window.prompt_hist, prompt, self.requests, rng),
                           sample_lengths(window.output_hist, output, self.requests, rng)))
        arrivals = poisson_requests(lengths, rate, self.seed)
        f_prefill, f_decode, basis = self._corrections(window, current, arrivals, prompt, output)
        corrected = _scaled(self.profile, f_prefill, f_decode)
        scores = {}
        for pools in splits(current.workers, aggregated=False):
            s = summarize(simulate(corrected, pools, arrivals), self.slo_ttft, self.slo_tpot)
            scores[pools] = (s["attainment"], max(s["ttft_p90"] / self.slo_ttft, s["tpot_p90"] / self.slo_tpot),
                             s["ttft_p90"], s["tpot_p90"])
        best = max(scores, key=lambda k: (scores[k][0], -scores[k][1]))
        ps, os_ = [p for p, _ in lengths], [o for _, o in lengths]
        load = (f"{rate:.2f} req/s, prompt tokens mean {prompt:.0f} / p50 {percentile(ps, 50):.0f} / p90 "
                f"{percentile(ps, 90):.0f}, output tokens mean {output:.0f} / p50 {percentile(os_, 50):.0f} / p90 "
                f"{percentile(os_, 90):.0f}; corrections prefill x{f_prefill:.2f}, decode x{f_decode:.2f} ({basis}); "
                f"predicted p90 TTFT / TPOT: " + ", ".join(f"{k} {v[2]:.2f}s / {v[3]:.3f}s" for k, v in scores.items()))
        if current not in scores or not _clearly_better(scores[best], scores[current]):
            return Decision(current, best, f"{load}: {current} stays")
        step = 1 if best.prefill > current.prefill else -1
        target = Pools(current.prefill + step, current.decode - step)
        return Decision(target, best, f"{load}: {best} serves it better "
                                      f"(attainment {scores[best][0]:.0%} vs {scores[current][0]:.0%}, "
                                      f"headroom ratio {scores[best][1]:.2f} vs {scores[current][1]:.2f})")


    def _corrections(self, window: Counters, current: Pools, arrivals, prompt: float,
                     output: float) -> tuple[float, float, str]:
        """(prefill factor, decode factor, what they came from): the workers' step times
        against the profile's price of the same steps where the scrape has them, else the
        observed mean TTFT and TPOT against a simulation of the current split."""
        from deploy.planner.sim_worker import StepShape

        decode, prefill = window.steps.get("decode"), window.steps.get("prefill")
        if decode and decode[1] > 0:
            batch = max(1, round(decode[2] / decode[1]))
            context = round(prompt + output / 2)
            f_decode = _factor(decode[0] / decode[1], self.profile.step_s(StepShape((context,) * batch, (), batch)))
            f_prefill, basis = f_decode, f"decode steps {decode[0] / decode[1] * 1e3:.1f} ms at batch {batch}"
            if prefill and prefill[1] > 0:
                tokens = max(1, round(prefill[3] / prefill[1]))
                f_prefill = _factor(prefill[0] / prefill[1], self.profile.step_s(StepShape((), ((0, tokens),), 1)))
                basis += f", prefill steps {prefill[0] / prefill[1] * 1e3:.1f} ms of {tokens} tokens"
            return f_prefill, f_decode, "workers' step times: " + basis
        predicted = summarize(simulate(self.profile, current, arrivals), self.slo_ttft, self.slo_tpot)
        f_prefill = _factor(window.ttft_sum / window.ttft_count if window.ttft_count else None, predicted["mean_ttft"])
        f_decode = _factor(window.tpot_sum / window.tpot_count if window.tpot_count else None, predicted["mean_tpot"])
        return f_prefill, f_decode, "no step times scraped: mean TTFT and TPOT"


def _factor(observed: float | None, predicted: float) -> float:
    if not observed or not predicted or predicted != predicted:
        return 1.0
    return min(CLAMP[1], max(CLAMP[0], observed / predicted))


def _scaled(profile: Profile, prefill: float, decode: float) -> Profile:
    """The profile with its costs corrected. A fitted step model prices whole steps, queueing
    is simulated: only the decode factor (observed TPOT, which is step time) scales it."""
    return dataclasses.replace(profile, prefill_coef=[c * prefill for c in profile.prefill_coef],
                               decode_coef=[c * decode for c in profile.decode_coef],
                               step_coef=[c * decode for c in profile.step_coef])


def _clearly_better(best: tuple[float, float], current: tuple[float, float]) -> bool:
    return best[0] >= current[0] + 0.05 or (best[0] >= current[0] and best[1] <= current[1] * (1 - MARGIN))
