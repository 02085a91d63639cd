"""The OpenAI-compatible HTTP front door (docs/design.md steps 1-4 and 10-11): routes only.
Never imports torch.

    POST /v1/chat/completions, POST /v1/completions   (stream or not)
    POST /v1/messages                                  (Anthropic's API, served as a chat request)
    POST /v1/responses, GET /v1/responses/{id}         (OpenAI's Responses API, served as a chat request)
    GET  /v1/models, /health, /ready, /metrics          (/metrics: the admin token off loopback)
    GET, PUT /admin/workers                            (the loopback admin socket only)

A request's path after its prompt is tokenized is gateway/request_path.py's; what the
gateway knows of its workers is gateway/readiness.py's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.tokenizer import ChatTemplateError, Tokenizer
from gateway import scrape
from gateway.front_door.admin_listener import AdminOnLoopback
from gateway.admission import Admission
from gateway.backend import Backend
from gateway.front_door.body_limit import BodyLimit
from gateway.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from gateway.metrics import REQUESTS
from gateway.messages.answer import messages_answer
from gateway.messages.errors import AnthropicErrors
from gateway.messages.protocol import MessagesRequest
from gateway.messages.request import chat_request
from gateway.front_door.metrics_access import metrics_refusal
from gateway.responses.answer import responses_answer
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.request import chat_request as responses_chat_request
from gateway.responses.request import responses_error
from gateway.responses.folder_store import FolderStore
from gateway.responses.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, MemoryStore
from gateway.completions.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, Membership, TokenizeRequest
from gateway.readiness import Readiness
from gateway.request_id import RequestId
from gateway.request_path import RequestPath
from gateway.retry_budget import RetryBudget
from gateway.routing.router import Router, WorkerState
from gateway.tenants import Tenant, Tenants
from gateway.front_door.trusted_proxies import SCOPE_KEY, ForwardedClient, Relay, TrustedProxies
from gateway.completions.tools import ToolPlan, render_messages
from rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    model_name: str  # what clients put in "model"
    model_path: Path  # local folder with the tokenizer
    decode: list[str]
    prefill: list[str] = field(default_factory=list)
    max_model_len: int = 8192
    host: str = "127.0.0.1"  # where the client port listens: off loopback, /metrics needs the admin token
    request_timeout_s: float | None = None  # a Generate call's deadline; None: derived (gateway/request_path.py)
    body_timeout_s: float = 30.0  # a client pausing longer while sending its body gets 408
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the context limit
    tenants: Tenants = field(default_factory=Tenants)
    health_interval_s: float = 2.0  # deep health of every worker; failing ones are skipped
    max_ttft_s: float | None = 60.0  # TTFT bound: shed past 75% of it, predicted (None: never shed)
    max_output_tokens: int | None = None  # cap on max_tokens, and its default (None: the context limit)
    admin_token: str | None = None  # enables PUT /admin/workers (membership pushed by the deploy controller)
    admin_port: int | None = None  # the loopback socket that alone serves /admin/* (gateway/front_door/admin_listener.py)
    # How requests stream from the decode workers: "worker" (default), all of them on one
    # Streams call per worker, one message per step; "request", one Generate call each (the
    # path before Streams, kept to measure against: bench/stream_path.py).
    decode_streams: str = "worker"
    # Stored responses for previous_response_id (gateway/responses/store.py): bytes
    # kept at most (0: none stored) and for how long; with `processes` gateway processes on
    # the port, the folder they share them in (None: this process's memory).
    response_store_bytes: int = DEFAULT_MAX_BYTES
    response_store_ttl_s: float = DEFAULT_MAX_AGE_S
    response_store_folder: Path | None = None
    processes: int = 1
    # Route on the prefix index the workers' KV events feed (gateway/routing/prefix_index.py): prefill
    # workers ranked and decode workers picked by the prefix each holds, and a sibling named
    # as a decode worker's prefix source. False: routing as before the index (rendezvous hash
    # for prefill, least outstanding tokens for decode, no prefix source), to measure against.
    prefix_routing: bool = True
    # The proxies whose X-Forwarded-For names the client (gateway/front_door/trusted_proxies.py); none by default.
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)
    # The gateway's own retries (gateway/retry_budget.py), shared with its other processes' (__main__).
    retry_budget: RetryBudget = field(default_factory=RetryBudget)


def create_app(config: GatewayConfig) -> FastAPI:
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    router = Router(config.decode, config.prefill, use_index=config.prefix_routing,
                    breaker_cool_down_s=config.health_interval_s)
    config.tenants.follow_pool(router.decode_pool_size)  # tenants with no max_concurrent of their own
    backend = Backend(config.decode, config.prefill, per_request=config.decode_streams == "request")
    admission = Admission(config.max_ttft_s)
    readiness = Readiness(router, backend, admission, config.health_interval_s)
    path = RequestPath(config, router, backend, admission, tokenizer, config.retry_budget)
    # A lone process keeps stored responses in its memory, the processes of one gateway in their shared folder
    response_store = (MemoryStore(config.response_store_bytes, config.response_store_ttl_s)
                      if config.response_store_folder is None else
                      FolderStore(config.response_store_folder, config.response_store_bytes,
                                  config.response_store_ttl_s, config.processes))
    controller_metrics: list[tuple[str, str]] = []  # the deploy controller's (incarnation, exposition), as of its last push

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(readiness.loop())
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
    app.add_middleware(RequestId)  # every answer names its request
    app.add_middleware(AnthropicErrors)  # every refusal on /v1/messages in Anthropic's shape
    app.add_middleware(ForwardedClient, proxies=config.trusted_proxies)  # outermost: who the client is

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = await readiness.ready()
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    async def _scrape() -> bytes:
        await readiness.observe()
        workers = await readiness.worker_metrics()
        if controller_metrics:
            name, text = controller_metrics[0]
            workers = [*workers, pb.MetricsResponse(worker=name, role="controller", exposition=text.encode())]
        # the parse and merge of every worker's text off the event loop: requests keep streaming meanwhile
        return await asyncio.to_thread(scrape.merge, generate_latest(), workers)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The one scrape; concurrent scrapes share one round of calls and one merge. Off
        loopback, other hosts need the admin token (gateway/front_door/metrics_access.py)."""
        refusal = metrics_refusal(config.host, request.client.host if request.client else None,
                                  request.headers.get("authorization"), config.admin_token,
                                  request.scope.get(SCOPE_KEY, Relay.DIRECT))
        if refusal is not None:
            raise refusal
        return Response(await readiness.shared("scrape", _scrape), media_type=CONTENT_TYPE_LATEST)

    def _check_admin(authorization: str | None) -> None:
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), (config.admin_token or "").encode()):
            raise APIError(401, "admin endpoints need the deployment's admin token", code="invalid_api_key")

    if config.admin_token:
        @app.get("/admin/workers", include_in_schema=False)
        async def get_workers(request: Request) -> dict:
            _check_admin(request.headers.get("authorization"))
            return {"decode": [_worker_view(w) for w in router.decode],
                    "prefill": [_worker_view(w) for w in router.prefill]}

        @app.put("/admin/workers", include_in_schema=False)
        async def put_workers(members: Membership, request: Request) -> dict:
            """The deploy controller's view of the pools: routing follows it from the next request."""
            _check_admin(request.headers.get("authorization"))
            if (members.decode, members.prefill) != ([w.address for w in router.decode],
                                                     [w.address for w in router.prefill]):
                log.info("workers now: decode %s, prefill %s", members.decode, members.prefill)
            router.set_workers(members.decode, members.prefill)
            await backend.set_workers(members.decode, members.prefill)
            if members.metrics:
                controller_metrics[:] = [(members.controller, members.metrics)]
            readiness.stale()
            return {"decode": members.decode, "prefill": members.prefill}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": config.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        tenant = _tenant(request)
        prompt, tools = await _chat_prompt(body, tenant)
        return await path.serve("chat", body, prompt, tenant, request, tools)

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API: the chat request it means (gateway/messages/request.py)
        on the chat path, its answer in Anthropic's shape (gateway/messages/answer.py)."""
        tenant = _tenant(request)
        chat_body = chat_request(body, tokenizer.renders_tools)
        prompt, tools = await _chat_prompt(chat_body, tenant)
        return messages_answer(await path.serve("chat", chat_body, prompt, tenant, request, tools), len(prompt))

    @app.post("/v1/responses")
    async def openai_responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API: the chat request it means (gateway/responses/request.py)
        on the chat path, its answer as a response (gateway/responses/answer.py)."""
        tenant = _tenant(request)
        history = await response_store.history(tenant.name, body.previous_response_id)
        chat_body, conversation = responses_chat_request(body, history)
        try:
            prompt, tools = await _chat_prompt(chat_body, tenant)
            answer = await path.serve("chat", chat_body, prompt, tenant, request, tools)
        except APIError as e:
            raise responses_error(e) from None
        keep = response_store.keeper(tenant.name, conversation) if body.store else None
        return await responses_answer(answer, body, keep)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> dict:
        """A stored response of the tenant's: 404 as an unknown one, 400 when none are stored."""
        return (await response_store.find(_tenant(request).name, response_id, "response_id")).response

    async def _chat_prompt(body: ChatCompletionRequest, tenant: Tenant) -> tuple[list[int], ToolPlan | None]:
        """A chat request's prompt token ids and how it uses its tools, or the APIError that
        refuses it before it is served."""
        _check_model(body.model)
        tools = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer.renders_tools)
        try:
            messages = render_messages(body.messages, tokenizer.renders_tools)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        if len(messages) > path.max_prompt():  # each message is a token at least: no need to render them
            raise APIError(413, f"{len(messages)} messages cannot fit in this model's limit of {path.max_prompt()} "
                                "prompt tokens", "messages")
        _shed_before_tokenizing(tenant, "chat", body.n)
        try:
            prompt = await asyncio.to_thread(_chat_ids, messages, tools.render if tools else None)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        except (TypeError, UnicodeError):  # e.g. a lone surrogate (valid JSON, not valid text)
            raise APIError(400, "messages: text is not valid Unicode (unpaired surrogate?)", "messages") from None
        return prompt, tools

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        tenant = _tenant(request)
        _check_model(body.model)
        _shed_before_tokenizing(tenant, "completions", body.n)
        if isinstance(body.prompt, str):
            try:
                prompt = await asyncio.to_thread(tokenizer.encode, body.prompt)
            except (TypeError, UnicodeError):  # e.g. a lone surrogate (valid JSON, not valid text)
                raise APIError(400, "prompt: text is not valid Unicode (unpaired surrogate?)", "prompt") from None
        else:
            prompt = list(body.prompt)
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return await path.serve("completion", body, prompt, tenant, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        """vLLM's /tokenize: the token ids a completion of this prompt (or chat) would run on."""
        _tenant(request)
        _check_model(body.model)
        try:
            if body.messages is not None:
                messages = render_messages(body.messages, tokenizer.renders_tools)
                text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, body.add_generation_prompt)
                ids = await asyncio.to_thread(tokenizer.encode, text, False)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except (TypeError, UnicodeError):
            raise APIError(400, "text is not valid Unicode (unpaired surrogate?)",
                           "messages" if body.messages is not None else "prompt") from None
        return {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids,
                "token_strs": tokenizer.tokens_of(ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        """vLLM's /detokenize: the text of these token ids."""
        _tenant(request)
        _check_model(body.model)
        if any(t < 0 or t >= tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    def _tenant(request: Request) -> Tenant:
        """The request's tenant, from its key (`Authorization: Bearer` or `x-api-key`)."""
        return config.tenants.authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))

    def _shed_before_tokenizing(tenant, endpoint: str, choices: int) -> None:
        """What would be refused whatever the prompt is refused before the prompt is
        tokenized (up to a megabyte of text): a tenant at its concurrency limit (its
        choices each count), an overload."""
        try:
            tenant.check_concurrency(choices)
            admission.check()
        except APIError as e:
            REQUESTS.labels(endpoint, str(e.status)).inc()
            raise

    def _chat_ids(messages: list[dict], tools: list[dict] | None) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools), add_special_tokens=False)

    def _check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")

    return app


def _worker_view(w: WorkerState) -> dict:
    """What the admin side sees of a worker: its state as routing knows it, its breaker's by name."""
    return {**{k: v for k, v in vars(w).items() if k != "breaker"}, "breaker": w.breaker.state.value}
