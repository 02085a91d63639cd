"""The claims a request holds in the gateway (gateway/request_path.py): taken in order,
undone when a start fails or is retried, and given back once on every path; and its
replays: within its one deadline, past a taker that refuses, spread over the others."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from gateway.admission import Admission
from gateway.app import GatewayConfig
from gateway.errors import APIError
from gateway.claims import Claims
from gateway.request_path import RequestPath
from gateway.routing.router import Router, WorkerState
from gateway.tenants import Tenant
from rpc import pdserve_pb2 as pb


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


class _Call:
    """A Generate stream as the backend hands it out: its first message, or the gRPC
    error the worker answered with."""

    def __init__(self, code: grpc.StatusCode | None):
        self.code = code

    async def read(self):
        await asyncio.sleep(0)  # the open awaits the worker, as a real one does: other replays pick meanwhile
        if self.code is not None:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")
        return pb.GenerateResponse(token_ids=[5])

    def cancel(self) -> None:
        pass


class _Backend:
    """Decode workers that answer as told: `refusing` maps an address to its gRPC error."""

    def __init__(self, refusing: dict[str, grpc.StatusCode] | None = None):
        self.refusing = refusing or {}
        self.opened: list[tuple[str, float]] = []  # (address, the call's timeout)

    def generate(self, address: str, req: pb.GenerateRequest, timeout: float) -> _Call:
        self.opened.append((address, timeout))
        return _Call(self.refusing.get(address))


def _path(backend: _Backend, decode: list[str], request_timeout_s: float = 100.0) -> RequestPath:
    config = GatewayConfig("smollm2", Path("."), decode, request_timeout_s=request_timeout_s)
    return RequestPath(config, Router(decode, []), backend, Admission(60.0), tokenizer=None)


def _claimed_on(path: RequestPath, address: str) -> Claims:
    claims = Claims(Tenant("t"), path.admission, cost=100, prompt_tokens=10, budget=path.budget)
    claims.take(kv_room=True)
    claims.on(next(w for w in path.router.decode if w.address == address))
    return claims


def _replay() -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r-replay1", prompt_token_ids=[1, 2, 3], output_token_ids=[4],
                              params=pb.SamplingParams(max_tokens=8))


def test_a_replay_runs_within_the_requests_one_deadline():
    """--request-timeout bounds the request in all: a replay gets what is left of it, not a
    fresh one, and none starts once it has passed."""
    backend = _Backend()
    path = _path(backend, ["a", "b"], request_timeout_s=100.0)
    address, _, _ = asyncio.run(path._reopen(_replay(), {"a"}, _claimed_on(path, "a"),
                                             deadline=time.monotonic() + 3.0))
    assert address == "b" and 0 < backend.opened[-1][1] <= 3.0, backend.opened
    with pytest.raises(APIError) as late:
        asyncio.run(path._reopen(_replay(), {"a"}, _claimed_on(path, "a"), deadline=time.monotonic() - 1))
    assert late.value.status == 504 and len(backend.opened) == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT])
def test_a_taker_that_refuses_a_replay_costs_a_try_on_the_next(code):
    """A taker overloaded (429) or refusing the replay (400) is not the end of a stream that
    already sent tokens: the next worker takes it, and the claim lands there alone."""
    backend = _Backend({"b": code})
    path = _path(backend, ["a", "b", "c"])
    path.router.decode[2].outstanding_tokens = 50  # b looks the better pick, and refuses
    claims = _claimed_on(path, "a")
    address, _, _ = asyncio.run(path._reopen(_replay(), {"a"}, claims, deadline=time.monotonic() + 60))
    assert address == "c" and [a for a, _ in backend.opened] == ["b", "c"]
    assert [w.outstanding_tokens for w in path.router.decode] == [0, 0, 150]


def test_a_drained_workers_replays_spread_over_the_others():
    """Eight streams handed off at once by a drained worker: each counts on the worker it
    picked at the pick, so they spread instead of all landing on the one least loaded before."""
    backend = _Backend()
    path = _path(backend, ["a", "b", "c"])

    def handed_off() -> pb.GenerateRequest:
        req = _replay()
        req.kv_source.address, req.kv_source.request_id = "a", "r"
        return req

    async def replay_all() -> list[str]:
        moves = [path._reopen(handed_off(), {"a"}, _claimed_on(path, "a"), deadline=time.monotonic() + 60)
                 for _ in range(8)]
        return [address for address, _, _ in await asyncio.gather(*moves)]

    landed = asyncio.run(replay_all())
    assert sorted(landed) == ["b"] * 4 + ["c"] * 4, landed
