"""One request's path through the gateway, after its prompt is tokenized: parameters, the
claims it holds while served, the decode worker it runs on (once more on another if the
first fails before its first token), and its answer, streamed or whole, whose headers say
how it was served (gateway/served.py). What it holds meanwhile is gateway/claims.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common import trace
from common.block_hash import block_hashes
from common.tokenizer import Tokenizer
from gateway import metrics
from gateway.completions.answer import collect_all, generate_events, sse
from gateway.admission import Admission
from gateway.backend import Backend
from gateway.claims import Claims
from gateway.client_gone import ClientGone, unless_gone
from gateway.decode_stream import DecodeStream
from gateway.errors import APIError
from gateway.metrics import REQUESTS, TTFT
from gateway.params import max_prompt_tokens, sampling_params
from gateway.request_id import arrived_at, client_request_id, set_request_id
from gateway.retry_budget import RetryBudget
from gateway.routing.router import NoWorker, Router
from gateway.served import Served
from gateway.tenants import Tenant
from gateway.completions.tools import ToolPlan
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)


# Decode workers a request is tried on, each a different one, while none of its tokens has
# reached the client: a worker that is draining, shutting down or dead costs a retry, not the request.
MAX_DECODE_ATTEMPTS = 3
# A Generate call's derived deadline (RequestPath.call_deadline_s): the old fixed bound to the
# first token, then each token at 10x the slowest measured step, never under 0.1 s a token.
FIRST_TOKEN_ALLOWANCE_S = 600.0
TOKEN_STRETCH = 10.0
MIN_TOKEN_S = 0.1


def derived_deadline_s(tokens_left: int, slowest_step_s: float) -> float:
    """A request's deadline when the user set none: FIRST_TOKEN_ALLOWANCE_S, then each token
    it may still generate at TOKEN_STRETCH x the slowest step measured (MIN_TOKEN_S at least)."""
    return FIRST_TOKEN_ALLOWANCE_S + max(1, tokens_left) * max(MIN_TOKEN_S, TOKEN_STRETCH * slowest_step_s)


class WorkerUnavailable(APIError):
    """The decode worker failed before the request's first token: it may go to another.
    `down`: the worker itself did not answer (no stream, or one that broke), so routing
    avoids it until its next health round; else it answered with an error of the request's."""

    def __init__(self, status: int, message: str, down: bool = True):
        super().__init__(status, message)
        self.down = down


class _ReleasingStream(StreamingResponse):
    """A streamed answer that awaits `on_close` when it ends, however it ends: even when the
    client left before its body was ever iterated. A client that leaves ends it at once,
    not at the next chunk it would have been sent (a preempted request sends none for a while)."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await unless_gone(receive, super().__call__(scope, receive, send))
        except ClientGone:
            pass
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


class RequestPath:
    """Serves tokenized requests: `await path.serve(kind, body, prompt, tenant, request)`."""

    def __init__(self, config, router: Router, backend: Backend, admission: Admission, tokenizer: Tokenizer,
                 budget: RetryBudget | None = None):
        self.config, self.router, self.backend = config, router, backend
        self.admission, self.tokenizer = admission, tokenizer
        self.budget = budget if budget is not None else RetryBudget()
        self._background: set[asyncio.Task] = set()

    def _measured_retry_after(self, e: APIError) -> None:
        """A 429 or 503 says when to come back from what the gateway measures: the time its
        queue takes to drain at the rate first tokens came (gateway/admission.py), or for no
        decode worker at all, the time to its next look at the workers. A prediction that
        already carries its own wait (predicted_ttft) keeps it."""
        if e.status not in (429, 503) or e.reason == "predicted_ttft":
            return
        wait = self.config.health_interval_s if e.status == 503 and not self.router.decode else \
            self.admission.drain_s()
        e.headers = {**(e.headers or {}), "Retry-After": str(max(1, math.ceil(wait)))}

    def max_prompt(self) -> int:
        return max_prompt_tokens(self.config.max_model_len, self.config.max_prompt_tokens)

    async def serve(self, kind: str, body, prompt: list[int], tenant: Tenant, request: Request,
                    tools: ToolPlan | None = None) -> Response:
        """The request's answer; `tools`: how a chat request uses its tools (gateway/completions/tools.py)."""
        config, router = self.config, self.router
        endpoint = "chat" if kind == "chat" else "completions"
        params = sampling_params(body, len(prompt), max_model_len=config.max_model_len, max_prompt=self.max_prompt(),
                                 kv_capacity=router.kv_capacity(), max_output_tokens=config.max_output_tokens,
                                 vocab_size=self.tokenizer.vocab_size)
        if tools is not None and tools.grammar is not None:
            if params.HasField("grammar"):
                raise APIError(400, 'response_format cannot be combined with tool_choice "required" or a named '
                                    "function: the output is the call", "response_format")
            params.grammar.CopyFrom(pb.Grammar(json_schema=tools.grammar.json_schema, strict=tools.grammar.strict))
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        set_request_id(request, rid)
        client_id = client_request_id(request)
        if client_id is not None:
            log.info("request %s: X-Request-Id %s", rid, client_id)
        trace.event(rid, "arrived", at=arrived_at(request), endpoint=endpoint, client_request_id=client_id,
                    prompt_tokens=len(prompt), max_tokens=params.max_tokens, stream=bool(body.stream))
        salt = tenant.cache_salt(body.cache_salt)
        hashes = block_hashes(prompt, router.block_size, salt)  # what the prefix index knows blocks by
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params, priority=tenant.priority,
                                 cache_salt=salt, tenant=tenant.name)
        started = time.monotonic()
        # One deadline for the whole request: its first worker's call, its retries, replays
        # and hand-offs all run within it (--request-timeout is the bound in all).
        deadline = started + self.call_deadline_s(req)
        call = None
        n = body.n  # parallel choices: one prefill, the rest start from the decode worker's prefix cache
        claims = Claims(tenant, self.admission, len(prompt) + n * params.max_tokens, len(prompt), n, self.budget)
        try:
            claims.take(kv_room=router.kv_room(len(prompt)))
        except APIError as e:
            self._measured_retry_after(e)
            REQUESTS.labels(endpoint, str(e.status)).inc()
            trace.event(rid, "refused", status=e.status, reason=e.reason)
            raise
        trace.event(rid, "admitted")
        calls: list[DecodeStream] = []
        try:
            try:
                calls = await unless_gone(request.receive, self._start(req, n, claims, endpoint, hashes, deadline))
            except APIError as e:  # the decode worker's compile refused the schema: name the parameter
                if e.status == 400 and ": grammar: " in e.message:
                    e.param = "tools" if tools is not None and tools.grammar is not None else "response_format"
                self._measured_retry_after(e)
                raise
        except ClientGone:  # before its first token: queueing and prefill stop at once
            REQUESTS.labels(endpoint, "cancelled").inc()
            trace.event(rid, "cancelled", before="first_token")
            return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
        finally:
            if len(calls) < n:
                claims.release()
        ttft = time.monotonic() - started
        served = Served.of(calls[0].address, calls[0].first)  # the answer's headers: gateway/served.py
        trace.event(rid, "first_token", **served.fields())
        claims.first_token()
        TTFT.observe(ttft)
        choices = [generate_events(kind, body, rid, call, call.first, len(prompt), started,
                                             started + ttft, endpoint, self.tokenizer, primary=i == 0)
                   for i, call in enumerate(calls)]

        async def finish() -> None:  # the end of the answer, however it came
            try:
                for events in choices:
                    await events.aclose()  # its metrics, if its reader stopped before its end
            finally:  # given back whatever the closing met: the tenant's slot is never kept
                claims.release(freed=all(call.finished for call in calls))
                for call in calls:
                    call.cancel()  # a client that left, or a stop string: the decode worker aborts

        if body.stream:
            return _ReleasingStream(sse(kind, rid, body, choices, config.model_name, self.tokenizer, tools),
                                    on_close=finish, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                             **served.headers(self.router.name_of)})
        try:
            answer = collect_all(kind, choices, rid, body, config.model_name, self.tokenizer, tools)
            return await _collect_unless_gone(request, answer, served.headers(self.router.name_of))
        finally:
            await finish()

    async def _siblings(self, req: pb.GenerateRequest, n: int, address: str, claims: Claims,
                        deadline: float) -> list[DecodeStream]:
        """Choices 1..n-1 on the decode worker that holds the first's prompt, prefilled there
        (no prefill workers: only the prompt's last, partial block is not in its prefix
        cache); a seeded request's choice i samples with seed + i. Opened at once, their
        first messages awaited; any refusal fails the whole request."""
        opened, children = [], []
        try:
            for i in range(1, n):
                child = pb.GenerateRequest()
                child.CopyFrom(req)
                child.request_id = f"{req.request_id}-{i}"
                del child.prefill_workers[:]
                child.ClearField("prefix_source")  # the first choice's fetch brought the prefix here
                if child.params.HasField("seed"):
                    child.params.seed = (child.params.seed + i) % 2**63
                children.append(child)
                opened.append(asyncio.ensure_future(self._open(address, child, deadline)))
            reopen = functools.partial(self._reopen, claims=claims, deadline=deadline)
            return [DecodeStream(child, address, call, first, reopen)
                    for child, (call, first) in zip(children, await asyncio.gather(*opened))]
        except BaseException:
            for task in opened:
                task.cancel()
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].cancel()
            raise

    async def _start(self, req: pb.GenerateRequest, n: int, claims: Claims, endpoint: str,
                     hashes: list[bytes], deadline: float) -> list:
        """Open the request's `n` Generate streams on one decode worker and wait for each
        one's first message. A worker that fails before that (refuses it while draining or
        shutting down, breaks, or ends it with an error and no token) costs a retry on
        another, up to MAX_DECODE_ATTEMPTS workers: no token has reached the client yet.
        Each try's route is one decision (Router.route): the prefill workers, the decode
        worker and a sibling holding more of the prefix than it (its prefix source), from
        one look-up of the prompt's block hashes (`hashes`) in the prefix index."""
        base, tried = req.request_id, []
        retrying = False  # this try is a retry: it holds room in the retry budget until its answer
        while True:
            try:
                route = self.router.route(req.prompt_token_ids, req.cache_salt, hashes, exclude=set(tried))
            except NoWorker:
                if retrying:
                    self.budget.release()
                REQUESTS.labels(endpoint, "503").inc()
                raise APIError(503, "no decode worker is available", headers={"Retry-After": "1"}) from None
            worker, source = route.decode, route.prefix_source
            claims.on(worker)
            req.prefill_workers[:] = route.prefill
            req.ClearField("prefix_source")
            if source is not None:
                req.prefix_source.address, req.prefix_source.blocks = source
                metrics.PREFIX_SOURCES.inc()
            trace.event(req.request_id, "sent", decode_worker=worker.address,
                        prefix_source=source[0] if source is not None else None)
            calls: list[DecodeStream] = []
            try:
                reopen = functools.partial(self._reopen, claims=claims, deadline=deadline)
                try:
                    opened = await self._open(worker.address, req, deadline)
                finally:
                    if retrying:
                        self.budget.release()
                        retrying = False
                worker.breaker.succeeded()
                calls.append(DecodeStream(req, worker.address, *opened, reopen))
                if n > 1:  # the others once the prompt's KV is on the decode worker: they find it cached there
                    calls += await self._siblings(req, n, worker.address, claims, deadline)
                return calls
            except BaseException as e:
                claims.off()
                for call in calls:
                    call.cancel()
                if isinstance(e, asyncio.CancelledError):  # its client left: nothing to count here
                    raise
                tried.append(worker.address)
                if isinstance(e, WorkerUnavailable):
                    worker.breaker.failed()
                others = [w for w in self.router.decode if w.address not in tried]
                if isinstance(e, WorkerUnavailable) and others and len(tried) < MAX_DECODE_ATTEMPTS:
                    if not await self.budget.acquire("before_first_token", deadline):
                        log.info("request %s: decode worker %s unavailable, and the retry budget had no room "
                                 "before its deadline: %s", req.request_id, worker.address, e.message)
                        REQUESTS.labels(endpoint, "503").inc()
                        raise APIError(503, f"decode worker unavailable ({e.message}), and the gateway's retry "
                                            "budget had no room for a retry before the request's deadline",
                                       code="retry_budget_spent") from None
                    retrying = True
                    log.info("request %s: decode worker %s unavailable, retrying on another: %s", req.request_id,
                             worker.address, e.message)
                    worker.healthy = worker.healthy and not e.down
                    # a fresh id: a prefill worker may still hold the failed attempt's (and refuse a duplicate)
                    req.request_id = f"{base}-retry" if len(tried) == 1 else f"{base}-retry{len(tried)}"
                    metrics.RETRIES.labels("before_first_token").inc()
                    continue
                refused = isinstance(e, APIError) and not isinstance(e, WorkerUnavailable)
                REQUESTS.labels(endpoint, str(e.status) if refused else "error").inc()  # a worker's 429 is a 429
                raise

    async def _reopen(self, req: pb.GenerateRequest, failed: set[str], claims: Claims,
                      deadline: float) -> tuple[str, object, pb.GenerateResponse]:
        """A replay (gateway/decode_stream.py) on a decode worker other than `failed`, each
        that fails to take it (down, draining, refusing it as overloaded or invalid there)
        costing another, up to MAX_DECODE_ATTEMPTS in all, within the request's one
        `deadline`; APIError when none is left. The request's routing cost moves with it (the
        first of its choices to move takes it), counted on each worker as it is picked: the
        streams of a drained worker, replayed at once, spread over the others instead of all
        picking the one that was least loaded before any of them landed."""
        hand_off = req.HasField("kv_source")  # a drained worker's: planned, it never waits for the budget
        try:
            if not await self.budget.acquire("handed_off" if hand_off else "mid_stream", deadline, required=hand_off):
                raise WorkerUnavailable(504, "the gateway's retry budget had no room for a replay before the "
                                             "request's deadline", down=False)
            try:
                return await self._replay(req, failed, claims, deadline)
            finally:
                self.budget.release()
        except BaseException:
            if hand_off:  # given up: the drained worker lets go of the KV it kept for a taker
                self._releasing(self.backend.release_kept(req.kv_source.address, req.kv_source.request_id))
            raise

    def _releasing(self, release: Awaitable[None]) -> None:
        task = asyncio.ensure_future(release)
        self._background.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._background.discard)

    async def _replay(self, req: pb.GenerateRequest, failed: set[str], claims: Claims,
                      deadline: float) -> tuple[str, object, pb.GenerateResponse]:
        """`_reopen`'s tries, once the budget let it retry."""
        tried = set(failed)
        req.ClearField("prefix_source")  # named for its first worker: a replay computes or copies its KV anew
        for worker in self.router.decode:
            worker.healthy = worker.healthy and worker.address not in failed  # until its next health round
        moving = claims.worker is not None and claims.worker.address in failed
        if moving:
            claims.off(freed=False)  # the failed worker frees its blocks on its own time
        last = "none tried"
        while len(tried) < MAX_DECODE_ATTEMPTS and any(w.address not in tried for w in self.router.decode):
            if deadline - time.monotonic() <= 0:
                raise WorkerUnavailable(504, "the request's deadline passed before a replay could start", down=False)
            worker = self.router.pick_decode(len(req.prompt_token_ids) + len(req.output_token_ids), exclude=tried)
            if moving:
                claims.on(worker)  # at the pick: the next replay picking now sees it
            try:
                call, first = await self._open(worker.address, req, deadline)
            except APIError as e:  # down or draining, overloaded (429) or refusing it (400): the next may take it
                if moving:
                    claims.off()
                log.info("request %s: replay on %s failed: %s", req.request_id, worker.address, e.message)
                if isinstance(e, WorkerUnavailable):
                    worker.healthy = worker.healthy and not e.down
                    worker.breaker.failed()
                tried.add(worker.address)
                last = e.message
                continue
            except BaseException:
                if moving:
                    claims.off()
                raise
            worker.breaker.succeeded()
            return worker.address, call, first
        raise WorkerUnavailable(503, f"no decode worker left to replay it on (tried {len(tried)}; last: {last})")

    def call_deadline_s(self, req: pb.GenerateRequest) -> float:
        """How long a Generate call may run: the user's `--request-timeout`, or derived from
        what the request may still do and how fast the decode workers measured themselves:
        FIRST_TOKEN_ALLOWANCE_S to its first token, then each token it may still generate at
        TOKEN_STRETCH x the slowest step measured (at least MIN_TOKEN_S a token). A long
        generation on a slow host gets the time it needs, not a fixed 600 s."""
        if self.config.request_timeout_s is not None:
            return self.config.request_timeout_s
        return derived_deadline_s(req.params.max_tokens - len(req.output_token_ids),
                                  self.router.slowest_decode_step_s())

    async def _open(self, address: str, req: pb.GenerateRequest, deadline: float):
        """The Generate stream and its first message (admission errors surface here), the
        call bounded by what is left of the request's `deadline` (time.monotonic())."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise APIError(504, "the request's deadline passed")
        call = self.backend.generate(address, req, left)
        try:
            first = await call.read()
        except asyncio.CancelledError:  # its client left: the decode worker drops it now
            call.cancel()
            raise
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, e.details()) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise APIError(429, f"overloaded: {e.details()}", headers={"Retry-After": "1"},
                               reason="worker_queue_full") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise APIError(504, "the request's deadline passed before its first token") from None
            raise WorkerUnavailable(503, f"decode worker unavailable ({code.name})") from None
        if first is grpc.aio.EOF:
            raise WorkerUnavailable(503, "decode worker closed the stream")
        if first.finish_reason == pb.ERROR and not first.token_ids:  # e.g. it shut down before the first token
            call.cancel()
            raise WorkerUnavailable(503, f"decode worker failed the request: {first.error.message}", down=False)
        return call, first


async def _collect_unless_gone(request: Request, collect, headers: dict[str, str]) -> Response:
    """A non-streamed answer, abandoned (and the decode worker's call cancelled) when the
    client disconnects: nobody would read it."""
    try:
        return JSONResponse(await unless_gone(request.receive, collect), headers=headers)
    except ClientGone:  # the gRPC call is cancelled and the claims released by the caller
        return Response(status_code=499)
