"""The claims a request holds in the gateway (gateway/request_path.py): taken in order,
undone when a start fails or is retried, and given back once on every path."""

from __future__ import annotations

import pytest

from gateway.admission import Admission
from gateway.errors import APIError
from gateway.request_path import Claims
from gateway.router import WorkerState
from gateway.tenants import Tenant


def test_a_failed_start_on_a_worker_undoes_its_claim_there_and_release_gives_back_the_rest_once():
    tenant, admission, worker, other = Tenant("t", max_concurrent=2), Admission(60.0), WorkerState("a"), WorkerState("b")
    claims = Claims(tenant, admission, cost=120, prompt_tokens=100)
    claims.take(kv_room=True)
    assert (tenant.in_flight, tenant.queued_tokens, admission.queued_tokens) == (1, 120, 100)
    claims.on(worker)
    assert (worker.outstanding_tokens, worker.kv_claimed_tokens) == (120, 100)
    claims.off()  # its start there failed: the retry goes elsewhere, and so does the KV it will use
    assert (worker.outstanding_tokens, worker.kv_claimed_tokens) == (0, 0)
    claims.on(other)
    claims.first_token()
    claims.release()
    claims.release()  # every path ends in release(); only the first counts
    assert (tenant.in_flight, tenant.queued_tokens, admission.queued_tokens) == (0, 0, 0)
    assert other.outstanding_tokens == 0 and other.kv_claimed_tokens == 0  # its KV is room again once it ended


def test_a_refusal_at_admission_holds_nothing():
    tenant = Tenant("t")
    claims = Claims(tenant, Admission(60.0), cost=10, prompt_tokens=8)
    with pytest.raises(APIError) as refused:
        claims.take(kv_room=False)
    assert refused.value.status == 429
    assert (tenant.in_flight, tenant.queued_tokens) == (0, 0)
    claims.release()
    assert (tenant.in_flight, tenant.queued_tokens) == (0, 0)


def test_a_requests_deadline_grows_with_its_tokens_and_the_measured_step():
    from gateway.request_path import FIRST_TOKEN_ALLOWANCE_S, derived_deadline_s

    assert derived_deadline_s(100, 0.0) == FIRST_TOKEN_ALLOWANCE_S + 100 * 0.1  # nothing measured: the floor
    fast, slow = derived_deadline_s(8000, 0.02), derived_deadline_s(8000, 0.3)
    assert fast == FIRST_TOKEN_ALLOWANCE_S + 8000 * 0.2 and slow == FIRST_TOKEN_ALLOWANCE_S + 8000 * 3.0
    assert slow > 600 * 10  # a long generation on a slow host: far past the old fixed 600 s
    assert derived_deadline_s(0, 0.3) == derived_deadline_s(1, 0.3)  # a replay with nothing left still gets one
