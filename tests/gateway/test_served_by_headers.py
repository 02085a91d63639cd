"""Every answer says how it was served (gateway/served.py): remote prefill on which prefill
worker with how many KV blocks, or local prefill and why, the decode worker and the prompt
tokens its prefix cache served. Real gateways over real workers: the shared 1P+1D system on
both ways to the decode worker (its Streams call, and one Generate call a request), its
decode worker alone behind a gateway with no prefill worker (aggregated), and a decode
worker that prefills short prompts itself (--local-prefill-threshold), and prefill workers
that fail."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from grpc import aio

from bench.harness.gateway_procs import CHAT, data_lines, gateway
from bench.harness.worker_procs import start_workers
from decode.step_batches import StepBatches, responses
from gateway.served import Served
from gateway.worker_streams import WorkerStreams
from rpc import pdserve_pb2 as pb

THRESHOLD = 64  # the threshold worker's --local-prefill-threshold


@pytest.fixture(scope="module")
def per_request(system, smollm2_dir, tmp_path_factory):
    """A gateway over `system`'s workers that opens one Generate call per request."""
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path_factory.mktemp("req") / "gateway.log",
                 "--decode-streams", "request") as url:
        yield url


@pytest.fixture(scope="module")
def threshold(system, smollm2_dir, tmp_path_factory):
    """A decode worker that prefills prompts of at most THRESHOLD uncached tokens itself,
    with `system`'s prefill worker for the rest; yields (url, decode worker)."""
    _, prefill, _ = system
    logs = tmp_path_factory.mktemp("threshold")
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256", "--local-prefill-threshold",
                                           str(THRESHOLD)], {})], smollm2_dir, logs, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [prefill.address], logs / "gateway.log") as url:
            yield url, decode
    finally:
        decode.stop()


def _long_prompt() -> str:
    """About 200 tokens none of which any earlier request cached (its first words are new)."""
    return f"{uuid.uuid4().hex} " + "The tides of the northern seas rise and fall with the moon. " * 16


def _complete(url: str, prompt: str, stream: bool) -> tuple[httpx.Headers, dict]:
    """A completion's headers and its usage (streamed: from the usage chunk)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.headers, resp.json()["usage"]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in data_lines(resp.iter_lines()) if line != "data: [DONE]"]
    return resp.headers, chunks[-1]["usage"]


def _served(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("x-pdserve-")}


def _remote(headers: httpx.Headers, usage: dict, prefill, decode) -> None:
    """Remote prefill on `prefill`, decoded on `decode`: the KV blocks that came over are the
    prompt's blocks past those the decode worker's prefix cache held."""
    block = decode.stats().block_size
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert _served(headers) == {
        "x-pdserve-decode-worker": decode.name, "x-pdserve-prefill": "remote",
        "x-pdserve-prefill-worker": prefill.name,
        "x-pdserve-kv-blocks": str(-(-usage["prompt_tokens"] // block) - cached // block),
        "x-pdserve-cached-tokens": str(cached)}


def _local(headers: httpx.Headers, reason: str, decode, cached: int | None = None) -> None:
    served = _served(headers)
    assert {k: v for k, v in served.items() if k != "x-pdserve-cached-tokens"} == {
        "x-pdserve-decode-worker": decode.name, "x-pdserve-prefill": "local",
        "x-pdserve-local-prefill-reason": reason}, served
    assert cached is None or served["x-pdserve-cached-tokens"] == str(cached), served


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["worker", "request"])
def test_a_remote_prefill_names_its_prefill_worker_and_the_kv_blocks_that_came_over(system, per_request, path,
                                                                                     stream):
    url, prefill, decode = system
    url = url if path == "worker" else per_request
    prompt = _long_prompt()
    headers, usage = _complete(url, prompt, stream)
    assert usage["prompt_tokens"] > 2 * decode.stats().block_size
    _remote(headers, usage, prefill, decode)
    assert headers["x-pdserve-cached-tokens"] == "0"
    # Again: the decode worker's prefix cache holds its full blocks, and only the rest comes over.
    headers, usage = _complete(url, prompt, stream)
    _remote(headers, usage, prefill, decode)
    assert int(headers["x-pdserve-cached-tokens"]) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_aggregated_system_prefills_locally_for_want_of_a_prefill_worker(system, aggregated, stream):
    _, _, decode = system
    url = str(aggregated.base_url).removesuffix("/v1/")
    headers, _ = _complete(url, _long_prompt(), stream)
    _local(headers, "no_prefill_worker", decode, cached=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_messages_answer_carries_the_same_headers(system, stream):
    url, prefill, decode = system
    body = {"model": "smollm2", "max_tokens": 3, "messages": [{"role": "user", "content": _long_prompt()}],
            "stream": stream}
    resp = httpx.post(f"{url}/v1/messages", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    served = _served(resp.headers)
    assert served["x-pdserve-prefill"] == "remote" and served["x-pdserve-prefill-worker"] == prefill.name
    assert served["x-pdserve-decode-worker"] == decode.name and int(served["x-pdserve-kv-blocks"]) > 0


def test_a_chat_answer_streamed_or_not_carries_the_headers(system):
    url, _, decode = system
    for stream in (False, True):
        body = {"model": "smollm2", "messages": CHAT, "max_tokens": 2, "temperature": 0, "stream": stream}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200
        assert _served(resp.headers)["x-pdserve-decode-worker"] == decode.name
        assert _served(resp.headers)["x-pdserve-prefill"] == "remote"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_below_the_threshold_or_cached_down_to_it_a_prompt_is_prefilled_where_it_decodes(system, threshold, stream):
    _, prefill, _ = system
    url, decode = threshold
    headers, _ = _complete(url, f"{uuid.uuid4().hex}: a short prompt", stream)
    _local(headers, "below_threshold", decode, cached=0)
    prompt = _long_prompt()
    headers, usage = _complete(url, prompt, stream)
    assert usage["prompt_tokens"] > THRESHOLD
    _remote(headers, usage, prefill, decode)
    # The same prompt again: its prefix cache leaves fewer than THRESHOLD tokens uncached.
    headers, usage = _complete(url, prompt, stream)
    assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] <= THRESHOLD
    _local(headers, "prefix_cache_hit", decode, cached=usage["prompt_tokens_details"]["cached_tokens"])


def test_a_remote_prefill_that_fails_is_prefilled_locally_and_says_why(system, smollm2_dir, tmp_path):
    """The only prefill worker offered refuses every Prefill (the decode worker itself: it
    serves only the KV it kept for a hand-off), so each request falls back to local prefill."""
    _, _, decode = system
    with gateway(smollm2_dir, [decode.address], [decode.address], tmp_path / "gateway.log") as url:
        for stream in (False, True):
            headers, _ = _complete(url, _long_prompt(), stream)
            _local(headers, "prefill_failed", decode, cached=0)


def test_how_a_stream_was_served_comes_on_its_first_message_when_steps_merge():
    """Two steps a decode worker gathered before its call's sender took either (a slow
    reader) go as one message: the first step's served entry and tokens, the second's tokens
    and the stream's last event. Read by the gateway's Streams reader, and as a Generate
    call's messages, the first message carries how it was served and the tokens keep their
    order (an event for the first step would have come after the second step's column)."""
    expected = {"decode_worker": "d", "prefill": "remote", "prefill_worker": "127.0.0.1:1", "kv_blocks": 3,
                "cached_tokens": 16}

    def two_steps(stream: int) -> pb.StreamsDown:
        batches = StepBatches()
        out = batches.outlet(stream)
        out.served(pb.Served(prefill_worker="127.0.0.1:1", kv_blocks=3, cached_prompt_tokens=16))
        out.tokens([11])
        batches.flush()
        out.tokens([12, 13])
        out.put(pb.GenerateResponse(token_ids=[14], finish_reason=pb.LENGTH))
        batches.flush()
        return pb.StreamsDown.FromString(batches.take(0).SerializeToString())  # as it crosses the wire

    async def read_on_the_gateway() -> list:
        channel = aio.insecure_channel("127.0.0.1:1")  # never called: the message is handed to the reader
        try:
            streams = WorkerStreams(channel, "d")
            streams._call = object()  # the call counts as open, so open() starts none
            call = streams.open(pb.GenerateRequest(), None)
            streams._deliver(two_steps(call.stream))
            return [await call.read() for _ in range(3)]
        finally:
            await channel.close()

    for msgs in (asyncio.run(read_on_the_gateway()), list(responses(two_steps(0)))):
        assert [list(m.token_ids) for m in msgs] == [[11], [12, 13], [14]]
        assert [m.HasField("served") for m in msgs] == [True, False, False]
        assert Served.of("d", msgs[0]).fields() == expected
