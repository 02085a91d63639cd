"""The OpenAI-compatible HTTP front door (DESIGN.md steps 1-4 and 10-11). Never imports torch.

    POST /v1/chat/completions, POST /v1/completions   (stream or not)
    GET  /v1/models, /health, /ready, /metrics
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.rpc import pdserve_pb2 as pb
from engine.tokenizer import ChatTemplateError, Tokenizer
from gateway.admission import Admission
from gateway.backend import Backend
from gateway.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from gateway.logprobs import render as render_logprobs
from gateway.protocol import ChatCompletionRequest, CompletionRequest, Membership
from gateway.router import NoWorker, Router
from gateway.tenants import Tenants
from gateway.text_stream import TextStream

log = logging.getLogger(__name__)

REQUESTS = Counter("pdserve_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"])
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30))
E2E = Histogram("pdserve_e2e_seconds", "Request latency", buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
TPOT = Histogram("pdserve_tpot_seconds", "Time per output token after the first",
                 buckets=(.01, .025, .05, .1, .2, .3, .5, 1, 2))
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests")
COMPLETION_TOKENS = Counter("pdserve_completion_tokens", "Output tokens of finished requests")
WORKER_GAUGES = {name: Gauge(f"pdserve_worker_{name}", doc, ["worker"]) for name, doc in {
    "kv_blocks_free": "Free KV blocks", "kv_blocks_total": "KV blocks", "waiting_requests": "Queued requests",
    "waiting_tokens": "Queued prompt tokens", "running_requests": "Running sequences",
    "prefix_cache_hit_rate": "Prefix-cache hit rate", "kv_blocks_transferred": "KV blocks moved over NIXL",
}.items()}

class WorkerUnavailable(APIError):
    """The decode worker failed before sending anything: the request may go to another."""


_FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort", pb.ERROR: "error"}


@dataclass
class GatewayConfig:
    model_name: str  # what clients put in "model"
    model_path: Path  # local folder with the tokenizer
    decode: list[str]
    prefill: list[str] = field(default_factory=list)
    max_model_len: int = 8192
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the context limit
    tenants: Tenants = field(default_factory=Tenants)
    health_interval_s: float = 2.0  # deep health of every worker; failing ones are skipped
    max_ttft_s: float | None = 60.0  # TTFT bound: shed past 75% of it, predicted (None: never shed)
    max_output_tokens: int | None = None  # cap on max_tokens, and its default (None: the context limit)
    admin_token: str | None = None  # enables PUT /admin/workers (membership pushed by the deploy controller)


def create_app(config: GatewayConfig) -> FastAPI:
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    router = Router(config.decode, config.prefill)
    backend = Backend(config.decode, config.prefill)
    ready_cache: dict[str, float | bool] = {"at": 0.0, "ok": False}
    admission = Admission(config.max_ttft_s)
    exported: set[str] = set()  # workers with series in the /metrics gauges

    def observe_stats(stats: dict[str, pb.StatsResponse | None]) -> None:
        """Workers' Stats into the router's KV headroom and the /metrics gauges."""
        for w in router.decode + router.prefill:
            s = stats.get(w.address)
            if s is not None and s.block_size:
                w.observe(s.free_blocks, s.total_blocks, s.block_size, s.waiting_tokens)
        live = {(s.worker or address) for address, s in stats.items() if s is not None}
        for gone in set(exported) - live:  # a replaced incarnation: its series end
            for gauge in WORKER_GAUGES.values():
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
            exported.discard(gone)
        exported.update(live)
        for address, s in stats.items():
            if s is None:
                continue
            values = {"kv_blocks_free": s.free_blocks, "kv_blocks_total": s.total_blocks,
                      "waiting_requests": s.waiting_requests, "waiting_tokens": s.waiting_tokens,
                      "running_requests": s.running_requests, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                      "kv_blocks_transferred": s.kv_blocks_transferred}
            for name, value in values.items():
                WORKER_GAUGES[name].labels(worker=s.worker or address).set(value)

    async def refresh_health() -> bool:
        """Deep-check every worker (the router skips the ones that fail) and read their Stats
        (the router's KV headroom). True if ready."""
        decode, prefill = list(router.decode), list(router.prefill)  # membership may change meanwhile
        decode_ok = await asyncio.gather(*(backend.health(w.address, deep=True) for w in decode))
        prefill_ok = await asyncio.gather(*(backend.health(w.address, deep=True) for w in prefill))
        observe_stats(await backend.all_stats())
        for w, ok in zip(decode + prefill, decode_ok + prefill_ok):
            if w.healthy != ok:
                log.info("worker %s is %s", w.address, "healthy again" if ok else "failing deep health")
            w.healthy = ok
        ready_cache.update(at=time.monotonic(), ok=any(decode_ok) and (not prefill or any(prefill_ok)))
        return bool(ready_cache["ok"])

    async def health_loop() -> None:
        while True:
            await asyncio.sleep(config.health_interval_s)
            try:
                await refresh_health()
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

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if time.monotonic() - ready_cache["at"] > config.health_interval_s:
            await refresh_health()
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
            ready_cache["at"] = 0.0  # the next /ready checks the new members
            return {"decode": members.decode, "prefill": members.prefill}

    @app.get("/metrics")
    async def metrics() -> Response:
        observe_stats(await backend.all_stats())
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
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params, priority=tenant.priority,
                                 prefill_workers=router.rank_prefill(prompt))
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
        stream = _responses(kind, body, rid, call, first, len(prompt), started, started + ttft, endpoint)

        async def released():
            try:
                async for item in stream:
                    yield item
            finally:
                worker.outstanding_tokens -= cost
                tenant.release(cost)
                call.cancel()  # a client that left, or a stop string: the decode worker aborts

        if body.stream:
            return StreamingResponse(_sse(kind, rid, body, released()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect_unless_gone(request, _collect(kind, released(), rid, body))

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

    async def _responses(kind, body, rid, call, first, prompt_len, started, first_at,
                         endpoint) -> AsyncIterator[dict]:
        """Each engine step's text as an event dict; the last carries finish_reason and usage."""
        text = TextStream(tokenizer, body.stop or [])
        msg, completion_tokens, status = first, 0, "ok"
        while True:
            completion_tokens += len(msg.token_ids)
            delta = text.push(list(msg.token_ids))
            finish = _FINISH.get(msg.finish_reason)
            if text.stopped:
                finish = "stop"
            elif finish is not None:
                delta += text.finish()
            if msg.error.code != pb.ERROR_NONE:
                status = "error"
                yield {"error": {"message": msg.error.message, "type": "server_error", "param": None,
                                 "code": pb.ErrorCode.Name(msg.error.code)}}
                break
            if delta or finish:
                yield {"text": delta, "finish_reason": finish, "logprobs": list(msg.logprobs)}
            if finish is not None:
                usage = {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_len + completion_tokens}
                if msg.usage.cached_prompt_tokens:
                    usage["prompt_tokens_details"] = {"cached_tokens": msg.usage.cached_prompt_tokens}
                yield {"usage": usage}
                break
            try:
                msg = await call.read()
            except grpc.RpcError as e:
                status = "error"
                yield {"error": {"message": f"decode worker failed mid-stream ({e.code().name})",
                                 "type": "server_error", "param": None, "code": None}}
                break
            if msg is grpc.aio.EOF:
                status = "error"
                yield {"error": {"message": "decode worker ended the stream early", "type": "server_error",
                                 "param": None, "code": None}}
                break
        REQUESTS.labels(endpoint, status).inc()
        now = time.monotonic()
        E2E.observe(now - started)
        if status == "ok":  # what the planner reads: the load and its latencies
            PROMPT_TOKENS.inc(prompt_len)
            COMPLETION_TOKENS.inc(completion_tokens)
            if completion_tokens > 1:
                TPOT.observe((now - first_at) / (completion_tokens - 1))

    async def _sse(kind: str, rid: str, body, events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """OpenAI's SSE framing: one chunk per event, usage if asked, then [DONE]."""
        base = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": config.model_name}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = True
        async for ev in events:
            if "error" in ev:
                yield _data(ev)
                break
            if "usage" in ev:
                if include_usage:
                    yield _data({**base, "choices": [], "usage": ev["usage"]})
                continue
            if kind == "chat":
                delta = {"role": "assistant", "content": ev["text"]} if first else {"content": ev["text"]}
                choice = {"index": 0, "delta": delta, "logprobs": render_logprobs(kind, tokenizer, ev["logprobs"]),
                          "finish_reason": ev["finish_reason"]}
            else:
                choice = {"index": 0, "text": ev["text"], "logprobs": render_logprobs(kind, tokenizer, ev["logprobs"]),
                          "finish_reason": ev["finish_reason"]}
            first = False
            yield _data({**base, "choices": [choice]})
        yield b"data: [DONE]\n\n"

    async def _collect(kind, events: AsyncIterator[dict], rid, body) -> dict:
        text, finish, usage, logprobs = [], None, None, []
        async for ev in events:
            if "error" in ev:
                raise APIError(503, ev["error"]["message"])
            if "usage" in ev:
                usage = ev["usage"]
            else:
                text.append(ev["text"])
                logprobs += ev["logprobs"]
                finish = ev["finish_reason"] or finish
        content = "".join(text)
        if kind == "completion" and body.echo and isinstance(body.prompt, str):
            content = body.prompt + content
        rendered = render_logprobs(kind, tokenizer, logprobs)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": rendered,
                   "finish_reason": finish} if kind == "chat" else
                  {"index": 0, "text": content, "logprobs": rendered, "finish_reason": finish})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": config.model_name, "choices": [choice], "usage": usage}

    return app


class BodyLimit:
    """413 for a declared body over the limit. Plain ASGI, not @app.middleware: Starlette's
    BaseHTTPMiddleware hides client disconnects from the endpoint (Request.is_disconnected)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = dict(scope.get("headers") or ()).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.max_bytes:
                body = {"error": {"message": f"request body over {self.max_bytes} bytes",
                                  "type": "invalid_request_error", "param": None, "code": None}}
                await JSONResponse(body, 413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _data(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
