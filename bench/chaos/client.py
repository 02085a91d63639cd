"""The HTTP client: a completion request, sent and classified by how it ended, and the
recovery probe."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable

import httpx

from bench.chaos.report import Outcome, Record
from bench.chaos.sizes import CLIENT_TIMEOUT_S, MODEL, RECOVERY_TIMEOUT_S, TOKENS
from gateway.front_door.head_deadline import CLIENT_KEEPALIVE_EXPIRY_S as KEEPALIVE_EXPIRY_S

# The tenant of every scenario's requests unless it names another: in the shared deployment's
# tenants file with no limit of its own, as the open gateway's one tenant (what the decode
# pool holds, one prefix cache shared).
DEFAULT_TENANT = "chaos"


def completion(prompt_len: int, max_tokens: int, rng: random.Random, stream: bool = True) -> dict:
    """Exactly max_tokens tokens on a fresh random prompt (no prefix-cache hits)."""
    return {"model": MODEL, "prompt": [rng.choice(TOKENS) for _ in range(prompt_len)], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}


def api_key(tenant: str) -> str:
    """The API key of `tenant` in the tenants file of the deployment the scenarios share
    (bench/chaos/scenarios.py)."""
    return "chaos-" + tenant.replace("/", "-")


def auth(tenant: str = DEFAULT_TENANT) -> dict[str, str]:
    """The Authorization header of `tenant`'s requests (an open gateway ignores it)."""
    return {"Authorization": f"Bearer {api_key(tenant)}"}


def client(tenant: str = DEFAULT_TENANT) -> httpx.AsyncClient:
    """The scenarios' HTTP client: every request is `tenant`'s, with its API key (an open
    gateway, as the overload's own deployment runs, ignores the key)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=10.0), headers=auth(tenant),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=32,
                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S))


async def send(http: httpx.AsyncClient, url: str, body: dict, *, leave_after_s: float | None = None,
               leave_after_chunks: int | None = None, on_text: Callable[[], None] | None = None,
               timeout_s: float = CLIENT_TIMEOUT_S, path: str = "/v1/completions") -> Record:
    """POST `path` (/v1/completions; or /v1/chat/completions) and say how it ended. The client
    leaves on purpose (closing the connection) after `leave_after_s` seconds or after
    `leave_after_chunks` text chunks.

    Hung means silent for `timeout_s`: no headers, and then no SSE event, for that long. A
    stream that keeps giving tokens is not hung however long its output takes: its length
    over the host's speed is not a bound (a 512-token stream on a host made 3x slower, under
    load, runs past any fixed total that a fast host meets). Its pace is reported apart
    (`gaps_s`, `max_gap_s`)."""
    rec = Record()
    exchange = _exchange(http, url + path, body, rec, leave_after_chunks, on_text)
    if leave_after_s is not None:
        try:
            await asyncio.wait_for(exchange, leave_after_s)
        except TimeoutError:
            rec.outcome = Outcome.CANCELLED
    elif not await heard_within(exchange, rec, timeout_s):
        rec.outcome, rec.error = Outcome.HUNG, f"nothing heard for {timeout_s:.0f}s"
    return rec


async def heard_within(exchange: Awaitable[None], rec: Record, silence_s: float) -> bool:
    """Run `exchange` to its end; False (and it is cancelled) once `rec` heard nothing for `silence_s`."""
    started, task = time.monotonic(), asyncio.ensure_future(exchange)

    def quiet_s() -> float:
        return time.monotonic() - (rec.heard_at or started)

    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=max(silence_s - quiet_s(), 0.0))
            if done:
                task.result()
                return True
            if quiet_s() >= silence_s:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return False
    except asyncio.CancelledError:
        task.cancel()
        raise


async def _exchange(http: httpx.AsyncClient, endpoint: str, body: dict, rec: Record, leave_after_chunks: int | None,
                    on_text: Callable[[], None] | None) -> None:
    t0 = rec.sent_at = rec.heard_at = time.monotonic()
    try:
        async with http.stream("POST", endpoint, json=body) as resp:
            rec.status, rec.answered_s = resp.status_code, time.monotonic() - t0
            rec.heard_at = time.monotonic()
            if resp.status_code != 200 or not body.get("stream"):
                _classify_body(rec, await resp.aread())
                return
            errored = finished = False
            last_text_s = 0.0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                rec.heard_at = time.monotonic()
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    rec.outcome = (Outcome.FAILED_CLEANLY if errored else
                                   Outcome.COMPLETED if finished else Outcome.DROPPED)
                    rec.error = rec.error or ("" if finished else "[DONE] without a finish_reason")
                    return
                if errored:
                    rec.error += "; an event after the error event"
                    return
                event = json.loads(data)
                if "error" in event:
                    errored, rec.error = True, str(event["error"].get("message"))
                    continue
                for choice in event.get("choices") or ():
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        rec.chunks += 1
                        now = time.monotonic()
                        if rec.ttft_s is not None:
                            rec.gaps_s.append(now - t0 - last_text_s)
                            rec.max_gap_s = max(rec.max_gap_s, rec.gaps_s[-1])
                        last_text_s = now - t0
                        if rec.ttft_s is None:
                            rec.ttft_s = time.monotonic() - t0
                            if on_text is not None:
                                on_text()
                    finished |= choice.get("finish_reason") is not None
                if leave_after_chunks is not None and rec.chunks >= leave_after_chunks and not finished:
                    rec.outcome = Outcome.CANCELLED  # leaving the block closes the connection
                    return
            rec.error = "the stream ended before [DONE]"
    except (httpx.HTTPError, ValueError) as e:  # transport, or an event that is not JSON
        rec.outcome, rec.error = Outcome.DROPPED, f"{type(e).__name__}: {e}"


def _classify_body(rec: Record, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if rec.status == 200:
        rec.outcome = Outcome.COMPLETED if isinstance(data, dict) and data.get("choices") else Outcome.DROPPED
        rec.usage = data.get("usage") if isinstance(data, dict) else None
    elif isinstance(error, dict) and "message" in error:
        rec.outcome, rec.code, rec.error = Outcome.FAILED_CLEANLY, error.get("code"), str(error["message"])
    else:
        rec.outcome, rec.error = Outcome.DROPPED, f"HTTP {rec.status} without a JSON error: {raw[:200]!r}"


async def recover(http: httpx.AsyncClient, url: str, since: float, rng: random.Random,
                  timeout_s: float = RECOVERY_TIMEOUT_S, prompt_len: int = 8) -> tuple[float | None, list[Record]]:
    """Fresh small requests, one after another, until one completes: seconds since `since`."""
    probes: list[Record] = []
    while time.monotonic() < since + timeout_s:
        rec = await send(http, url, completion(prompt_len, 2, rng, stream=False), timeout_s=60.0)
        probes.append(rec)
        if rec.outcome is Outcome.COMPLETED:
            return time.monotonic() - since, probes
        await asyncio.sleep(0.25)
    return None, probes


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)
    return True
