"""The online planner: from the load the gateway observed, which split of the same workers
would serve it best, and one step towards it.

Each window (the controller's `planner.interval_s`) reads the gateway's counters: finished
requests, prompt and output tokens, and the sums behind mean TTFT and TPOT. The profile's
cost models are first corrected so the simulator reproduces what was observed on the
current split (correction factors: observed / predicted mean TTFT scales the prefill
model, observed / predicted mean TPOT the decode model, each clamped to [0.5, 4]), as
NVIDIA Dynamo's planner does with its interpolators. Then every split of the same total
with at least one worker per pool is simulated at the observed rate and mean lengths and
scored by SLO attainment, then by headroom (the worse of p90 TTFT / SLO and p90 TPOT /
SLO). A split that beats the current one by a clear margin is the target; the controller
moves one worker per decision and waits out a cool-down, draining before it removes.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from dataclasses import dataclass

from deploy.profile import Profile
from deploy.simulator import Pools, poisson_requests, simulate, summarize

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

    def minus(self, earlier: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(earlier))))


def parse_metrics(text: str) -> Counters:
    from prometheus_client.parser import text_string_to_metric_families

    c = Counters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_requests_total" and sample.labels.get("status") == "ok":
                c.requests += sample.value
            elif sample.name in _COUNTERS:
                setattr(c, _COUNTERS[sample.name], getattr(c, _COUNTERS[sample.name]) + sample.value)
    return c


def scrape(gateway_url: str, timeout_s: float = 5.0) -> Counters:
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=timeout_s) as resp:
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
        prompt = max(1, round(window.prompt_tokens / n))
        output = max(1, round(window.output_tokens / n))
        lengths = [(prompt, output)] * self.requests
        arrivals = poisson_requests(lengths, rate, self.seed)
        predicted = summarize(simulate(self.profile, current, arrivals), self.slo_ttft, self.slo_tpot)
        f_prefill = _factor(window.ttft_sum / window.ttft_count if window.ttft_count else None, predicted["mean_ttft"])
        f_decode = _factor(window.tpot_sum / window.tpot_count if window.tpot_count else None, predicted["mean_tpot"])
        corrected = _scaled(self.profile, f_prefill, f_decode)
        total = current.prefill + current.decode
        scores = {}
        for p in range(1, total):
            pools = Pools(p, total - p)
            s = summarize(simulate(corrected, pools, arrivals), self.slo_ttft, self.slo_tpot)
            scores[pools] = (s["attainment"], max(s["ttft_p90"] / self.slo_ttft, s["tpot_p90"] / self.slo_tpot))
        best = max(scores, key=lambda k: (scores[k][0], -scores[k][1]))
        load = (f"{rate:.2f} req/s, {prompt} prompt / {output} output tokens; corrections prefill x{f_prefill:.2f}, "
                f"decode x{f_decode:.2f}")
        if current not in scores or not _clearly_better(scores[best], scores[current]):
            return Decision(current, best, f"{load}: {current} stays")
        step = 1 if best.prefill > current.prefill else -1
        target = Pools(current.prefill + step, current.decode - step)
        return Decision(target, best, f"{load}: {best} serves it better "
                                      f"(attainment {scores[best][0]:.0%} vs {scores[current][0]:.0%}, "
                                      f"headroom ratio {scores[best][1]:.2f} vs {scores[current][1]:.2f})")


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
