"""The gateway's one retry policy (gateway/retry_budget.py, gateway/routing/circuit_breaker.py): its
own retries drawn from one budget that all its processes share, a breaker per decode worker
that takes one failing in a row out of routing until a probe gets through, and a Retry-After
on every 429/503 from what it measures. The request path is driven over stand-in workers
(tests/gateway/test_request_path.py's), the budget's sharing over a real shared table."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.admission import Admission
from gateway.routing.circuit_breaker import CircuitBreaker, State
from gateway.errors import APIError
from gateway.retry_budget import RetryBudget
from gateway.tenant_table import TenantTable
from tests.gateway.test_request_path import _Backend, _claimed_on, _path, _replay
from rpc import pdserve_pb2 as pb


def test_the_budget_is_a_share_of_the_requests_in_flight_across_processes(tmp_path):
    """Two gateway processes on one shared row: ten requests in flight between them allow
    max(3, 20% of 10) = 3 retry attempts at once, whichever process asks; a fourth waits for
    room (one given back by the other process) instead of failing, and is refused only once
    its deadline passes; a hand-off takes its place at once, over the budget if need be."""
    TenantTable.create(tmp_path / "counts", rows=2, processes=2)
    budgets = []
    for process in (0, 1):
        budget = RetryBudget()
        budget.share(TenantTable.open(tmp_path / "counts", 2, 2, process).row(1))
        budgets.append(budget)
    for i in range(10):
        budgets[i % 2].started()

    async def attempts() -> None:
        soon = time.monotonic() + 30
        assert [await budgets[i % 2].acquire("mid_stream", soon) for i in range(3)] == [True, True, True]
        assert not await budgets[0].acquire("mid_stream", time.monotonic() + 0.05)  # no room before its deadline
        waiting = asyncio.ensure_future(budgets[1].acquire("before_first_token", soon))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # it waits ...
        budgets[0].release()  # ... until another process's attempt has its answer
        assert await asyncio.wait_for(waiting, 5)
        assert await budgets[0].acquire("handed_off", time.monotonic(), required=True)  # a drain's: at once
        assert budgets[0].shared.totals() == (10, 4)

    asyncio.run(attempts())


def test_a_breaker_opens_after_failures_in_a_row_and_a_probe_closes_it():
    now = [0.0]
    breaker = CircuitBreaker(cool_down_s=2.0, failures=3, clock=lambda: now[0])
    for _ in range(2):
        breaker.failed()
    breaker.succeeded()  # not in a row
    for _ in range(3):
        breaker.failed()
    assert breaker.state is State.OPEN and not breaker.allows()
    now[0] = 2.5
    assert breaker.allows()
    breaker.picked()  # the probe
    assert breaker.state is State.HALF_OPEN and not breaker.allows()  # one at a time
    breaker.failed()  # the probe failed: open again, for twice as long
    assert breaker.state is State.OPEN and breaker.reopens_at == pytest.approx(2.5 + 4.0)
    now[0] = 7.0
    breaker.picked()
    breaker.succeeded()
    assert breaker.state is State.CLOSED and breaker.allows() and breaker.cool_down_s == 2.0


def test_a_worker_that_keeps_failing_is_passed_over_until_its_probe_succeeds():
    """Decode worker a fails every request before its first token (each costs a retry on b):
    after five in a row its breaker opens and requests go to b first; past the cool-down one
    is let through to a as the probe."""
    backend = _Backend({"a": grpc.StatusCode.UNAVAILABLE})
    path = _path(backend, ["a", "b"])
    a = path.router.decode[0]
    a.breaker.base_cool_down_s = a.breaker.cool_down_s = 0.2

    async def serve_one() -> str:
        req = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=pb.SamplingParams(max_tokens=4))
        claims = _claimed_on(path, "b")
        claims.off()
        calls = await path._start(req, 1, claims, "completions", [], deadline=time.monotonic() + 60)
        claims.release()
        return calls[0].address

    for _ in range(5):
        path.router.decode[1].outstanding_tokens = 10**6  # b looks busier: a is picked first
        a.healthy = True  # its deep health passes (the case a breaker is for): only its requests fail
        assert asyncio.run(serve_one()) == "b"
        a.healthy = True
    opened = len(backend.opened)
    assert a.breaker.state is State.OPEN
    assert asyncio.run(serve_one()) == "b" and len(backend.opened) == opened + 1  # straight to b
    time.sleep(0.25)
    assert asyncio.run(serve_one()) == "b" and backend.opened[-2][0] == "a"  # the probe went to a
    backend.refusing.clear()  # a recovers (and its next health round says so)
    a.healthy = True
    time.sleep(0.5)  # the failed probe doubled the cool-down
    path.router.decode[1].outstanding_tokens = 10**6
    assert asyncio.run(serve_one()) == "a" and a.breaker.state is State.CLOSED


def test_a_replay_with_no_room_before_its_deadline_ends_cleanly_and_a_hand_off_never_waits():
    path = _path(_Backend(), ["a", "b"])
    path.budget.minimum, path.budget.ratio = 0, 0.0  # no room for any retry
    claims = _claimed_on(path, "a")
    with pytest.raises(APIError) as refused:
        asyncio.run(path._reopen(_replay(), {"a"}, claims, deadline=time.monotonic() + 0.1))
    assert refused.value.status == 504 and "retry budget" in refused.value.message
    handed_off = _replay()
    handed_off.kv_source.address, handed_off.kv_source.request_id = "a", "r"
    address, _, _ = asyncio.run(path._reopen(handed_off, {"a"}, claims, deadline=time.monotonic() + 60))
    assert address == "b" and path.budget.retrying == 0  # given back once it had its answer


def test_a_refusal_says_when_to_come_back_from_the_measured_queue():
    """Retry-After is the time the admitted queue takes to drain at the measured first-token
    rate, not a constant: ten requests queued at a measured 2 per second say 5 s."""
    clock = [0.0]
    admission = Admission(None, window=4, clock=lambda: clock[0])
    for _ in range(4):  # four first tokens, one every half second: 2 requests a second
        ticket = admission.admit(10)
        clock[0] += 0.5
        admission.first_token(ticket)
    for _ in range(10):
        admission.admit(10)
    path = _path(_Backend(), ["a"])
    path.admission = admission
    refusal = APIError(429, "tenant t: 4 concurrent sequences", reason="tenant_concurrency",
                       headers={"Retry-After": "1"})
    path._measured_retry_after(refusal)
    assert refusal.headers["Retry-After"] == "5", refusal.headers
