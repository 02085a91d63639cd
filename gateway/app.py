"""The OpenAI-compatible HTTP front door (DESIGN.md steps 1-4 and 10-11). Never imports torch.

    POST /v1/chat/completions, POST /v1/completions   (stream or not)
    GET  /v1/models, /health, /ready, /metrics
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.tokenizer import ChatTemplateError, Tokenizer
from gateway import responses
from gateway.admin_listener import AdminOnLoopback
from gateway.admission import Admission
from gateway.backend import Backend
from gateway.body_limit import BodyLimit
from gateway.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from gateway.metrics import REQUESTS, TTFT, WorkerGauges
from gateway.protocol import ChatCompletionRequest, CompletionRequest, Membership
from gateway.router import NoWorker, Router
from gateway.tenants import Tenants
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)


class WorkerUnavailable(APIError):
    """The decode worker failed before sending anything: the request may go to another."""


@dataclass
class GatewayConfig:
    model_name: str  # what clients put in "model"
    model_path: Path  # local folder with the tokenizer
    decode: list[str]
    prefill: list[str] = field(default_factory=list)
    max_model_len: int = 8192
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0  # a client pausing longer while sending its body gets 408
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the context limit
    tenants: Tenants = field(default_factory=Tenants)
    health_interval_s: float = 2.0  # deep health of every worker; failing ones are skipped
    max_ttft_s: float | None = 60.0  # TTFT bound: shed past 75% of it, predicted (None: never shed)
    max_output_tokens: int | None = None  # cap on max_tokens, and its default (None: the context limit)
    admin_token: str | None = None  # enables PUT /admin/workers (membership pushed by the deploy controller)
    admin_port: int | None = None  # the loopback socket that alone serves /admin/* (gateway/admin_listener.py)


def create_app(config: GatewayConfig) -> FastAPI:
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    router = Router(config.decode, config.prefill)
    backend = Backend(config.decode, config.prefill)
    ready_cache: dict[str, float | bool] = {"at": -math.inf, "ok": False}  # never checked: stale
    admission = Admission(config.max_ttft_s)
    gauges = WorkerGauges()

    def observe_stats(stats: dict[str, pb.StatsResponse | None]) -> None:
        """Workers' Stats into the router's KV headroom and the /metrics gauges."""
        for w in router.decode + router.prefill:
            s = stats.get(w.address)
            if s is not None and s.block_size:
                w.observe(s.free_blocks, s.total_blocks, s.block_size, s.waiting_tokens)
        # admission's prior: the prompt tokens per second the prefilling pool measured itself at
        prefilling = router.prefill or router.decode
        admission.observe_capacity(sum(s.prefill_tokens_per_s for w in prefilling
                                       if w.healthy and (s := stats.get(w.address)) is not None))
        gauges.export(stats)

    async def refresh_health() -> bool:
        """Deep-check every worker (the router skips the ones that fail) and read their Stats
        (the router's KV headroom). True if ready."""
        decode, prefill = list(router.decode), list(router.prefill)  # membership may change meanwhile
        decode_h = await asyncio.gather(*(backend.health(w.address, deep=True) for w in decode))
        prefill_h = await asyncio.gather(*(backend.health(w.address, deep=True) for w in prefill))
        observe_stats(await backend.all_stats())
        decode_ok, prefill_ok = [h.ok for h in decode_h], [h.ok for h in prefill_h]
        for w, h in zip(decode + prefill, decode_h + prefill_h):
            if w.healthy != h.ok:
                log.info("worker %s is %s", w.address, "healthy again" if h.ok else f"failing deep health: {h.detail}")
            w.healthy = h.ok
        ready_cache.update(at=time.monotonic(), ok=any(decode_ok) and (not prefill or any(prefill_ok)))
        return bool(ready_cache["ok"])

    in_flight: dict[str, asyncio.Task] = {}

    async def shared(name: str, fn):
        """`fn()` one at a time: callers that come while one runs share its result (a flood of
        /ready or /metrics costs the workers one round, not one each)."""
        task = in_flight.get(name)
        if task is None or task.done():
            task = in_flight[name] = asyncio.create_task(fn())
        return await asyncio.shield(task)

    async def refresh_once() -> bool:
        return await shared("health", refresh_health)

    async def health_loop() -> None:
        while True:
            await asyncio.sleep(config.health_interval_s)
            try:
                await refresh_once()
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health check round failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await backend.close()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, authenticate=config.tenants.authenticate,
                       body_timeout_s=config.body_timeout_s)
    if config.admin_token:  # outermost: /admin/* on the loopback admin socket only
        app.add_middleware(AdminOnLoopback, admin_port=config.admin_port if config.admin_port is not None else -1)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if time.monotonic() - ready_cache["at"] > config.health_interval_s:
            await refresh_once()
        status = 200 if ready_cache["ok"] else 503
        return JSONResponse({"ready": bool(ready_cache["ok"])}, status)

    def _check_admin(authorization: str | None) -> None:
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), (config.admin_token or "").encode()):
            raise APIError(401, "admin endpoints need the deployment's admin token", code="invalid_api_key")

    if config.admin_token:
        @app.get("/admin/workers", include_in_schema=False)
        async def get_workers(request: Request) -> dict:
            _check_admin(request.headers.get("authorization"))
            return {"decode": [vars(w) for w in router.decode], "prefill": [vars(w) for w in router.prefill]}

        @app.put("/admin/workers", include_in_schema=False)
        async def put_workers(members: Membership, request: Request) -> dict:
            """The deploy controller's view of the pools: routing follows it from the next request."""
            _check_admin(request.headers.get("authorization"))
            if (members.decode, members.prefill) != ([w.address for w in router.decode],
                                                     [w.address for w in router.prefill]):
                log.info("workers now: decode %s, prefill %s", members.decode, members.prefill)
            router.set_workers(members.decode, members.prefill)
            await backend.set_workers(members.decode, members.prefill)
            ready_cache["at"] = -math.inf  # the next /ready checks the new members
            return {"decode": members.decode, "prefill": members.prefill}

    @app.get("/metrics")
    async def metrics() -> Response:
        observe_stats(await shared("stats", backend.all_stats))  # Stats only: counters, no forward pass
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": config.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        tenant = config.tenants.authenticate(request.headers.get("authorization"))
        _check_model(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        if len(messages) > _max_prompt():  # each message is a token at least: no need to render them
            raise APIError(413, f"{len(messages)} messages cannot fit in this model's limit of {_max_prompt()} "
                                "prompt tokens", "messages")
        _shed_before_tokenizing(tenant, "chat")
        try:
            prompt = await asyncio.to_thread(_chat_ids, messages)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        except (TypeError, UnicodeError):  # e.g. a lone surrogate (valid JSON, not valid text)
            raise APIError(400, "messages: text is not valid Unicode (unpaired surrogate?)", "messages") from None
        return await _serve("chat", body, prompt, tenant, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        tenant = config.tenants.authenticate(request.headers.get("authorization"))
        _check_model(body.model)
        _shed_before_tokenizing(tenant, "completions")
        if isinstance(body.prompt, str):
            try:
                prompt = await asyncio.to_thread(tokenizer.encode, body.prompt)
            except (TypeError, UnicodeError):  # e.g. a lone surrogate (valid JSON, not valid text)
                raise APIError(400, "prompt: text is not valid Unicode (unpaired surrogate?)", "prompt") from None
        else:
            prompt = list(body.prompt)
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return await _serve("completion", body, prompt, tenant, request)

    def _shed_before_tokenizing(tenant, endpoint: str) -> None:
        """What would be refused whatever the prompt is refused before the prompt is
        tokenized (up to a megabyte of text): a tenant at its concurrency limit, an overload."""
        try:
            tenant.check_concurrency()
            admission.check()
        except APIError as e:
            REQUESTS.labels(endpoint, "429").inc()
            raise

    def _chat_ids(messages: list[dict]) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def _check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")

    def _max_prompt() -> int:
        return min(config.max_prompt_tokens or config.max_model_len, config.max_model_len - 1)

    def _params(body, prompt_len: int) -> pb.SamplingParams:
        limit = config.max_model_len - prompt_len
        prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        max_prompt = _max_prompt()
        if prompt_len > max_prompt:
            raise APIError(413, f"prompt ({prompt_len} tokens) is over this model's limit of {max_prompt} prompt "
                                "tokens", prompt_param)
        capacity = router.kv_capacity()  # the largest decode worker's KV cache, once known
        if capacity is not None and prompt_len >= capacity:
            raise APIError(413, f"prompt ({prompt_len} tokens) does not fit in a decode worker's KV cache "
                                f"({capacity} tokens)", prompt_param)
        cap = config.max_output_tokens
        if cap is not None and body.output_limit is not None and body.output_limit > cap:
            raise APIError(400, f"max_tokens ({body.output_limit}) is over this server's limit of {cap}", "max_tokens")
        default = min(limit, cap or limit, limit if capacity is None else capacity - prompt_len)
        max_tokens = body.output_limit if body.output_limit is not None else default
        if max_tokens > limit:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                f"limit of {config.max_model_len} tokens", "max_tokens")
        if capacity is not None and prompt_len + max_tokens > capacity:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs more KV cache than "
                                f"a decode worker has ({capacity} tokens)", "max_tokens")
        p = pb.SamplingParams(max_tokens=max_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed"):
            value = getattr(body, name)
            if value is not None:
                setattr(p, name, value)
        if body.logit_bias:
            for key, value in body.logit_bias.items():
                if int(key) >= tokenizer.vocab_size:
                    raise APIError(400, f"logit_bias key {key} is not a token id of this model", "logit_bias")
                p.logit_bias[int(key)] = value
        if body.num_logprobs is not None:
            p.logprobs = body.num_logprobs
        p.ignore_eos = body.ignore_eos
        return p

    async def _serve(kind: str, body, prompt: list[int], tenant, request: Request):
        endpoint = "chat" if kind == "chat" else "completions"
        params = _params(body, len(prompt))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        salt = tenant.cache_salt(body.cache_salt)
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params, priority=tenant.priority,
                                 prefill_workers=router.rank_prefill(prompt, salt), cache_salt=salt)
        started = time.monotonic()
        cost = len(prompt) + params.max_tokens
        try:
            tenant.admit(cost)
        except APIError:
            REQUESTS.labels(endpoint, "429").inc()
            raise
        try:
            ticket = admission.admit(len(prompt), kv_room=router.kv_room(len(prompt)))
        except APIError:
            tenant.release(cost)
            REQUESTS.labels(endpoint, "429").inc()
            raise
        tried: set[str] = set()
        while True:  # a decode worker that fails before the first token: once more on another
            try:
                worker = router.pick_decode(len(prompt), exclude=tried)
            except NoWorker:
                tenant.release(cost)
                admission.first_token(ticket, served=False)
                REQUESTS.labels(endpoint, "503").inc()
                raise APIError(503, "no decode worker is available", headers={"Retry-After": "1"}) from None
            worker.outstanding_tokens += cost
            worker.kv_claimed_tokens += len(prompt)
            try:
                call, first = await _start(worker.address, req)
                break
            except BaseException as e:
                worker.outstanding_tokens -= cost
                retry = isinstance(e, WorkerUnavailable) and not tried and router.has_other_decode(worker)
                if retry:
                    log.info("request %s: decode worker %s unavailable, retrying on another", rid, worker.address)
                    worker.healthy = False
                    tried.add(worker.address)
                    # a fresh id: a prefill worker may still hold the dead attempt's (and refuse a duplicate)
                    req.request_id = f"{rid}-retry"
                    continue
                tenant.release(cost)
                admission.first_token(ticket, served=False)
                REQUESTS.labels(endpoint, "error").inc()
                raise
        ttft = time.monotonic() - started
        admission.first_token(ticket)
        TTFT.observe(ttft)
        stream = responses.generate_events(kind, body, rid, call, first, len(prompt), started, started + ttft,
                                           endpoint, tokenizer)

        async def released():
            try:
                async for item in stream:
                    yield item
            finally:
                worker.outstanding_tokens -= cost
                tenant.release(cost)
                call.cancel()  # a client that left, or a stop string: the decode worker aborts

        if body.stream:
            return StreamingResponse(responses.sse(kind, rid, body, released(), config.model_name, tokenizer),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answer = responses.collect(kind, released(), rid, body, config.model_name, tokenizer)
        return await _collect_unless_gone(request, answer)

    async def _collect_unless_gone(request: Request, collect) -> Response:
        """A non-streamed answer, abandoned (and the decode worker's call cancelled) when the
        client disconnects: nobody would read it."""
        task = asyncio.ensure_future(collect)
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await request.is_disconnected():
                task.cancel()  # unwinds through released(): the gRPC call is cancelled, the slots freed
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
        return JSONResponse(task.result())

    async def _start(address: str, req: pb.GenerateRequest):
        """Open the Generate stream and wait for its first message (admission errors surface here)."""
        call = backend.generate(address, req, config.request_timeout_s)
        try:
            first = await call.read()
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, e.details()) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise APIError(429, f"overloaded: {e.details()}", headers={"Retry-After": "1"}) from None
            raise WorkerUnavailable(503, f"decode worker unavailable ({code.name})") from None
        if first is grpc.aio.EOF:
            raise WorkerUnavailable(503, "decode worker closed the stream")
        return call, first

    return app
