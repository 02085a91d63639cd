"""The serving comparison's own parts (bench/peer_serving.py, bench/peer_proxy.py): the router
in front of vLLM engines, run for real on loopback in front of two small HTTP servers that
answer as vLLM's OpenAI server does (what the router is tested for is its routing: the
P/D request flow and the passing on of streams and errors), and the command's arguments and
client comparison. The comparison itself, with vLLM, is a benchmark (bench/RESULTS.md)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.peer_proxy import Pool, build
from bench.peer_serving import clients_agree, parse
from bench.serving_metrics import SLO, Load, RequestRecord, Run, Status, summarize

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]], "remote_engine_id": "p0",
      "remote_request_id": "r-1", "remote_host": "127.0.0.1", "remote_port": 5601}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app: FastAPI) -> str:
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "a test server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}"


def _engine(name: str, seen: list, kv_params: dict | None = None) -> FastAPI:
    """An OpenAI-style completions server: non-streamed answers carry `kv_transfer_params`
    when given (a vLLM prefill engine's answer), streamed ones send three chunks slowly."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if body.get("max_tokens", 1) > 100:
            return JSONResponse({"error": {"message": "max_tokens too large"}}, 400)
        if not body.get("stream"):
            answer = {"id": "c", "choices": [{"text": "x"}]}
            if kv_params is not None:
                answer["kv_transfer_params"] = kv_params
            return answer

        async def chunks():
            for i in range(3):
                yield f"data: {json.dumps({'choices': [{'text': f'{name}{i}'}]})}\n\n"
                time.sleep(0.05)
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def _stream(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data:")]


def test_the_router_spreads_streams_over_aggregated_engines():
    seen_a, seen_b = [], []
    proxy = _serve(build([_serve(_engine("a", seen_a)), _serve(_engine("b", seen_b))], [], []))
    threads = [threading.Thread(target=_stream, args=(proxy, {"prompt": [1, 2], "max_tokens": 3, "stream": True}))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen_a) == 2 and len(seen_b) == 2  # least in flight, ties in turn
    lines = _stream(proxy, {"prompt": [1], "max_tokens": 3, "stream": True})
    assert lines[-1] == "data: [DONE]" and len(lines) == 4  # the engine's chunks, as they were


def test_the_router_runs_vllms_pd_flow_prefill_first_then_decode_with_its_kv_params():
    seen_p, seen_d = [], []
    proxy = _serve(build([], [_serve(_engine("p", seen_p, KV))], [_serve(_engine("d", seen_d))]))
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    lines = _stream(proxy, body)
    assert [json.loads(x[5:])["choices"][0]["text"] for x in lines[:-1]] == ["d0", "d1", "d2"]
    ask = seen_p[0]
    assert ask["max_tokens"] == 1 and ask["stream"] is False and "stream_options" not in ask
    assert ask["kv_transfer_params"]["do_remote_decode"] is True and ask["prompt"] == [5, 6, 7]
    assert seen_d[0] == {**body, "kv_transfer_params": KV}  # the original request, with where its KV is


def test_the_router_passes_errors_on_and_names_a_prefill_engine_without_the_connector():
    seen = []
    proxy = _serve(build([_serve(_engine("a", seen))], [], []))
    r = httpx.post(f"{proxy}/v1/completions", json={"prompt": [1], "max_tokens": 500, "stream": True}, timeout=30)
    assert r.status_code == 400 and "too large" in r.json()["error"]["message"]
    proxy = _serve(build([], [_serve(_engine("p", []))], [_serve(_engine("d", []))]))  # no kv_transfer_params
    r = httpx.post(f"{proxy}/v1/completions", json={"prompt": [1], "max_tokens": 4, "stream": True}, timeout=30)
    assert r.status_code == 502 and "NixlConnector" in r.json()["error"]["message"]
    assert httpx.get(f"{proxy}/health", timeout=30).status_code == 200


def test_pool_picks_the_least_loaded_then_takes_turns():
    pool = Pool(["a", "b", "c"])
    pool.in_flight.update(a=2, b=0, c=1)
    assert pool.pick() == "b"
    pool.in_flight.update(a=0, b=0, c=0)
    assert {pool.pick() for _ in range(3)} == {"a", "b", "c"}


def test_the_command_checks_its_arguments():
    args = parse(["--rates", "fixed=1,2", "--systems", "vllm 1P+1D,pdserve 1P+1D"])
    assert args.rate_of["fixed"] == [1.0, 2.0] and args.rate_of["sharegpt"] == [1.0, 2.0, 3.0]
    for bad in (["--systems", "sglang"], ["--rates", "fixed=a"], ["--rates", "nope=1"], ["--rates", "fixed=-1"],
                ["--cores", "4", "--systems", "vllm 2x1"], ["--workloads", "chat"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_the_clients_are_compared_on_their_p50s():
    recs = [RequestRecord(10, 4, 0.0, ttft_s=0.1 + i / 1000, tpot_s=0.02, itl_s=[0.02, 0.02], e2e_s=0.2, status=Status.OK) for i in range(21)]
    run = Run(Load(rate=1.0), 10.0, summarize(recs, 10.0, SLO(1, 1)), recs)
    rows = clients_agree(run, {"median_ttft_ms": 104.0, "median_itl_ms": 25.0})
    assert run.summary["ttft_s"]["p50"] == pytest.approx(0.110)
    assert rows["ttft"]["agree"] and rows["ttft"]["difference"] == pytest.approx(0.104 / 0.110 - 1)
    assert not rows["itl"]["agree"] and rows["itl"]["difference"] == pytest.approx(0.25)
