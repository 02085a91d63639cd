"""A minimal router in front of vLLM servers, for the serving comparison (bench/peer_serving.py).

    python -m bench.peer_proxy --port 8100 --backend http://127.0.0.1:8101 --backend http://127.0.0.1:8102
    python -m bench.peer_proxy --port 8100 --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102

Two modes, the same routing vLLM's own example proxies do, so that vLLM is measured as its
users deploy it and not through pdserve's gateway:
- `--backend` (several): aggregated engines; each request goes to the backend with the
  fewest requests in flight (ties in turn), its answer streamed back as it comes.
- `--prefill` / `--decode`: vLLM's P/D with its NixlConnector. A completion first goes to a
  prefill server as a non-streamed request of one token whose `kv_transfer_params` ask for
  remote decode; the prefill server computes the prompt's KV, keeps it, and answers with
  the `kv_transfer_params` that say where it is; the original request then goes to a decode
  server with those parameters, which pulls the KV over NIXL and streams the answer.

Only POST /v1/completions and /v1/chat/completions (and GET /health, /v1/models) are routed:
what the benchmark sends. An error from a backend is passed to the client with its status.
"""

from __future__ import annotations

import argparse
import itertools
import json

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class Pool:
    """Backends of one kind; `pick` takes the one with the fewest requests in flight."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.in_flight = dict.fromkeys(urls, 0)
        self._turn = itertools.count()

    def pick(self) -> str:
        turn = next(self._turn)
        order = self.urls[turn % len(self.urls):] + self.urls[:turn % len(self.urls)]
        return min(order, key=lambda u: self.in_flight[u])


def build(backends: list[str], prefill: list[str], decode: list[str]) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    serving = Pool(decode or backends)
    prefilling = Pool(prefill) if prefill else None

    async def relay(url: str, path: str, body: dict) -> Response:
        """Send `body` to `url` and pass its answer on, streamed if it streams."""
        serving.in_flight[url] += 1
        try:
            req = client.build_request("POST", url + path, json=body)
            resp = await client.send(req, stream=True)
        except BaseException:
            serving.in_flight[url] -= 1
            raise
        if resp.status_code != 200 or not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            serving.in_flight[url] -= 1
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))

        async def chunks():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                serving.in_flight[url] -= 1
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def route(request: Request, path: str) -> Response:
        body = await request.json()
        if prefilling is not None:
            ask = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}}
            ask.pop("stream_options", None)
            if "max_completion_tokens" in ask:
                ask["max_completion_tokens"] = 1
            url = prefilling.pick()
            prefilling.in_flight[url] += 1
            try:
                resp = await client.post(url + path, json=ask)
            finally:
                prefilling.in_flight[url] -= 1
            if resp.status_code != 200:
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            params = resp.json().get("kv_transfer_params")
            if not params:
                return JSONResponse({"error": {"message": "the prefill server returned no kv_transfer_params: is "
                                               "it running with the NixlConnector?", "type": "proxy_error"}}, 502)
            body = {**body, "kv_transfer_params": params}
        return await relay(serving.pick(), path, body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        for url in (prefilling.urls if prefilling else []) + serving.urls:
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        resp = await client.get(serving.urls[0] + "/v1/models")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", action="append", default=[], help="an aggregated server (repeatable)")
    p.add_argument("--prefill", action="append", default=[], help="a P/D prefill server (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="a P/D decode server (repeatable)")
    args = p.parse_args(argv)
    if bool(args.prefill) != bool(args.decode) or bool(args.backend) == bool(args.prefill):
        p.error("give --backend servers, or --prefill and --decode servers")
    print(json.dumps({"proxy": f"{args.host}:{args.port}", "backends": args.backend, "prefill": args.prefill,
                      "decode": args.decode}), flush=True)
    uvicorn.run(build(args.backend, args.prefill, args.decode), host=args.host, port=args.port,
                log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
