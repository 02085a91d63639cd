"""gateway/admission.py: the TTFT prediction behind load shedding, against a simulated FIFO
server whose capacity the test knows (a fake clock: no real time passes)."""

from __future__ import annotations

from collections import deque

import pytest

from gateway.admission import Admission
from gateway.errors import APIError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(adm: Admission, clock: Clock, arrivals: list[tuple[float, int]], per_request_s: float,
             per_token_s: float) -> tuple[list[float], int]:
    """A FIFO server taking per_request_s + prompt * per_token_s per request; returns the
    admitted requests' TTFTs and the number refused."""
    queue: deque = deque()
    ttfts, refused, free_at = [], 0, 0.0
    pending = deque(sorted(arrivals))
    while pending or queue:
        next_arrival = pending[0][0] if pending else float("inf")
        if queue and max(free_at, queue[0][1]) + queue[0][2] <= next_arrival:
            ticket, arrived, service = queue.popleft()
            clock.now = free_at = max(free_at, arrived) + service
            adm.first_token(ticket)
            ttfts.append(clock.now - arrived)
            continue
        clock.now, prompt = pending.popleft()
        try:
            queue.append((adm.admit(prompt), clock.now, per_request_s + prompt * per_token_s))
        except APIError as e:
            assert e.status == 429 and e.code == "overloaded" and int(e.headers["Retry-After"]) >= 1
            refused += 1
    return ttfts, refused


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


@pytest.mark.parametrize("per_request_s, per_token_s, prompt", [
    (0.45, 0.0, 64),  # per-request costs dominate (this CPU's disaggregated path)
    (0.0, 1 / 3000, 800),  # prefill compute dominates
    (0.05, 1 / 3000, 64),
])
def test_at_5x_capacity_admitted_requests_keep_the_bound_and_the_rest_is_refused(per_request_s, per_token_s, prompt):
    clock = Clock()
    adm = Admission(max_ttft_s=4.0, clock=clock)
    service = per_request_s + prompt * per_token_s
    warm = [(i * service * 1.25, prompt) for i in range(40)]  # at 80% of capacity first
    start = 40 * service * 1.25
    over = [(start + i * service / 5, prompt) for i in range(int(30 / (service / 5)))]  # 30 s at 5x
    ttfts, refused = simulate(adm, clock, warm + over, per_request_s, per_token_s)
    assert p90(ttfts) <= 4.0, p90(ttfts)
    assert refused > 0.6 * len(over)
    served_in_overload = len(ttfts) - len(warm)
    assert served_in_overload * service > 0.8 * 30  # shedding does not starve the server


def test_a_cold_burst_is_admitted_by_the_priors_and_one_stuck_request_sheds_nobody():
    clock = Clock()
    adm = Admission(max_ttft_s=4.0, clock=clock)  # priors: 4 requests/s, 2000 tokens/s
    admitted = []
    with pytest.raises(APIError):
        while True:
            admitted.append(adm.admit(64))
    assert len(admitted) == 12  # (11 queued + 1) / 4 per s = 3.0 s: 75% of the bound
    clock.now = 3.0
    for t in admitted[1:]:  # all but the first get their first tokens
        adm.first_token(t)
    clock.now = 60.0  # the first one is stuck (a stuck transfer, a wedged worker)
    assert adm.rates()[0] == pytest.approx(32 / (3.0 + 21 / 4))  # frozen, not decayed
    for _ in range(5):
        adm.first_token(adm.admit(64))  # others are still admitted and served
    adm.first_token(admitted[0], served=False)
    assert adm.queued_requests == adm.queued_tokens == 0
    adm.admit(100_000)  # nothing queued: nothing to shed for, whatever the rate says


def test_idle_time_does_not_dilute_the_rate_and_a_ticket_counts_once():
    clock = Clock()
    adm = Admission(max_ttft_s=4.0, window=4, clock=clock)
    for _ in range(10):  # one at a time: queued 0.25 s each, with idle time between
        t = adm.admit(100)
        clock.now += 0.25
        adm.first_token(t)
        adm.first_token(t)  # counted once
        clock.now += 5.0
    assert adm.rates() == pytest.approx((4.0, 400.0))
    assert adm.queued_requests == adm.queued_tokens == 0
    t = adm.admit(100)
    clock.now += 1.0
    adm.first_token(t, served=False)  # a failure is not a first token: the rate stands
    assert adm.rates() == pytest.approx((4.0, 400.0))


def test_a_long_prompt_is_not_refused_for_its_own_length():
    clock = Clock()
    adm = Admission(max_ttft_s=4.0, clock=clock)
    short = adm.admit(64)
    long = adm.admit(30_000)  # 15 s of prefill at the prior rate, but only 64 tokens ahead of it
    with pytest.raises(APIError):
        adm.admit(64)  # behind those 30k tokens: refused
    adm.first_token(short)
    adm.first_token(long)


def test_kv_room_is_checked_first():
    with pytest.raises(APIError, match="KV cache room"):
        Admission(None).admit(10, kv_room=False)


def test_a_slow_host_starts_from_its_own_measured_speed_not_the_fixed_priors():
    """Before its window fills, admission assumes the speed the workers measured. A host 20x
    slower than the fixed priors, at 5x its capacity from a cold start: with the fixed priors
    every early request is admitted (the AVX2 host's 0 x 429 and an 18 s TTFT p90); with the
    measured prior the admitted ones keep the bound from the first request on."""
    prompt, per_token_s = 400, 20 / 2000  # the fixed prior is 2000 tokens/s; this host does 100
    service = prompt * per_token_s  # 4 s a request
    arrivals = [(i * service / 5, prompt) for i in range(30)]  # 5x capacity, from cold

    fixed_clock = Clock()
    fixed = Admission(max_ttft_s=12.0, clock=fixed_clock)
    fixed_ttfts, fixed_refused = simulate(fixed, fixed_clock, arrivals, 0.0, per_token_s)

    clock = Clock()
    adm = Admission(max_ttft_s=12.0, clock=clock)
    adm.observe_capacity(1 / per_token_s)  # what the workers' Stats report
    assert adm.priors() == pytest.approx((1 / per_token_s / 128, 1 / per_token_s))  # no prompt seen: the floor
    ttfts, refused = simulate(adm, clock, arrivals, 0.0, per_token_s)
    assert max(fixed_ttfts) > 12.0 and p90(ttfts) <= 12.0, (p90(fixed_ttfts), p90(ttfts))
    assert refused > fixed_refused
    assert adm.priors()[0] == pytest.approx(1 / per_token_s / prompt)  # per request: the mean prompt admitted
    adm.observe_capacity(0.0)  # nothing reported: the fixed priors again
    assert adm.priors() == adm.prior


def test_an_overload_is_refused_before_the_prompt_is_known():
    """check() sheds on what is queued ahead, before the gateway tokenizes the prompt."""
    clock = Clock()
    adm = Admission(max_ttft_s=10.0, clock=clock)
    adm.check()  # nothing queued: never shed
    adm.observe_capacity(100.0)  # a slow system: 100 prompt tokens per second, 0.5 requests of 200
    for _ in range(3):
        adm.admit(200)  # each predicted within 75% of the bound when it came (2, 4 and 6 s)
    with pytest.raises(APIError) as e:  # a fourth would wait 8 s, whatever its own prompt
        adm.check()
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
