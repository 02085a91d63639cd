"""gateway/admission.py: the TTFT prediction behind load shedding, fed the first tokens of a
simulated prefill queue whose true rate and fixed latency the test knows."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, Ticket
from gateway.errors import APIError

RATE = 3000.0  # prompt tokens per second the simulated prefill serves
BASE = 0.15  # seconds of fixed latency per request


def ttft(ticket: Ticket) -> float:
    """FIFO service: the tokens ahead and its own, at RATE, after the fixed latency."""
    return BASE + (ticket.ahead + ticket.prompt_tokens) / RATE


def test_an_idle_system_admits_anything_and_kv_room_is_checked_first():
    adm = Admission(max_ttft_s=1.0, initial_rate_tokens_s=1.0)  # absurdly slow prior
    t = adm.admit(100_000)  # nothing queued: nothing to shed for
    with pytest.raises(APIError) as e:
        adm.admit(10)
    assert e.value.status == 429 and "too close to the 1.0s bound" in e.value.message
    with pytest.raises(APIError, match="KV cache room"):
        Admission(None).admit(10, kv_room=False)
    adm.first_token(t, None)  # failed before its first token: counted out, nothing learnt
    assert adm.queued_tokens == 0 and adm.rate == 1.0


def test_learns_the_rate_and_base_of_a_queue_from_its_first_tokens():
    adm = Admission(max_ttft_s=None, initial_rate_tokens_s=100.0)
    for _ in range(3):  # unqueued requests: the fixed latency
        t = adm.admit(64)
        adm.first_token(t, ttft(t))
    for _ in range(30):  # bursts of 8 that queue behind each other
        burst = [adm.admit(64) for _ in range(8)]
        for t in burst:
            adm.first_token(t, ttft(t))
    assert adm.base_s == pytest.approx(BASE + 64 / RATE)
    assert adm.rate == pytest.approx(RATE, rel=0.15)
    queued = [adm.admit(256) for _ in range(10)]
    assert adm.predicted_ttft(64) == pytest.approx(ttft(Ticket(64, 2560)), rel=0.1)
    for t in queued:
        adm.first_token(t, ttft(t))
    assert adm.queued_tokens == 0


def test_a_requests_own_prompt_over_its_ttft_would_undercount_the_rate():
    """The earlier estimator (own prompt / TTFT) learnt ~80 tokens/s from these bursts, and
    so predicted over 6 s for a ninth: it shed 8 closed-loop clients served in under 1 s."""
    adm = Admission(max_ttft_s=4.0)
    for _ in range(50):
        burst = [adm.admit(64) for _ in range(8)]  # never shed
        for t in burst:
            adm.first_token(t, ttft(t) + 0.5)  # a slow decode side: TTFT 0.67-0.82 s
    assert adm.predicted_ttft(8 * 64) < 1.5


def test_sheds_before_the_prediction_reaches_the_bound():
    adm = Admission(max_ttft_s=2.0, initial_rate_tokens_s=RATE)
    admitted = []
    with pytest.raises(APIError) as e:
        while True:
            admitted.append(adm.admit(500))
    assert e.value.headers["Retry-After"] == "1"
    # 75% of the bound: room for the prediction's error
    assert adm.predicted_ttft(0) <= 0.75 * 2.0 < adm.predicted_ttft(500)
    assert [t.ahead for t in admitted] == [500 * i for i in range(len(admitted))]
