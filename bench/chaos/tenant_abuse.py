"""The tenants scenario: issue 44's tenant attacks made from outside the gateway, while a
victim tenant streams and its inter-token latency is compared with its own unloaded one.

On the deployment the scenarios share, whose tenants file has `TENANTS` and whose gateway
has `GATEWAY`: an output cap that lets a request reach the log-probability bound, and a short
body deadline. The attacks:

1. a tenant that shares its prefix cache sends the `cache_salt` the old code derived for an
   isolated tenant ("tenant:team/iso"), and an isolated tenant whose name plus its salt spelled
   it ("team" + "iso"), after the isolated tenant sent a long prompt: no cached token;
2. n > 1 requests, streamed and not, left halfway by their client at the tenant's
   `max_concurrent`: afterwards a request for n = max_concurrent is served, and n above it is a 400;
5. distinct slow-compiling JSON schemas at the tenant's limit: each served or refused cleanly,
   and the victim's own uncached schema sent right after is served;
6. `logit_bias` +100 on a token that decodes to a lone U+FFFD, a long streamed output (the
   full run's is the output cap; --quick's, a quarter of it, still 16 times the ids the
   detokenizer may hold back: common/detokenizer.py);
7. n = 16 x top_logprobs 20 x a long max_tokens, not streamed: a 400 naming the bound;
8. slow bodies from one other address, past its connection cap (bench/chaos/slow_bodies.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import AsyncExitStack

import httpx

from bench.chaos.client import api_key, client, completion, send
from bench.chaos.context import Chaos, settle
from bench.chaos.report import Outcome, Record, Result
from bench.chaos.sizes import MODEL
from bench.chaos.slow_bodies import SlowBodies, slow_bodies
from bench.serving_metrics import percentile
from gateway.params import MAX_LOGPROB_ENTRIES

ABUSER_LIMIT = 4  # the abusing tenant's max_concurrent
WIDE = 16  # n of the log-probability request (the protocol's most), and its tenant's max_concurrent
LOGPROB_TOKENS = MAX_LOGPROB_ENTRIES // (WIDE * 21) + 1  # with top_logprobs 20: just past the bound
MAX_OUTPUT_TOKENS = 512  # the shared deployment's cap on max_tokens: room for LOGPROB_TOKENS
MAX_BODY_BYTES = 64 * 1024  # a body's whole deadline is the body timeout + this at 16 KiB/s: 4 s more
BODY_TIMEOUT_S = 8.0  # the shared deployment's (the default 30 would hold each slow body 34 s): > 2 s a byte
HEADER_TIMEOUT_S = 5.0  # and its heads' (the default 10): abuse's heads sent byte by byte end at it
PER_IP_CAP = 256  # the gateway's default --max-connections-per-ip: a quarter of --max-connections (1024)
PAST_THE_CAP = 16  # slow bodies past it
VICTIM_TOKENS = 32  # each victim stream's output
VICTIM_STREAMS = 2  # victim streams at a time
UNLOADED_REQUESTS = 6  # per victim stream, before the abuse (a few seconds: a steadier median)
LONG_PROMPT = 256  # item 1's prompt: 16 KV blocks
ITL_BOUND = 2.0  # the victim's ITL during the abuse, over its unloaded one

TENANTS = [
    {"name": "victim"},
    {"name": "team/iso"},  # isolated, a name with "/": the old salt "tenant:team/iso"
    {"name": "team"},  # isolated: the old code joined its salt "iso" into the same string
    {"name": "sharer", "share_prefix_cache": True, "max_concurrent": WIDE},
    {"name": "abuser", "share_prefix_cache": True, "max_concurrent": ABUSER_LIMIT},
]
GATEWAY = {"max_output_tokens": MAX_OUTPUT_TOKENS, "max_body_bytes": MAX_BODY_BYTES,
           "body_timeout_s": BODY_TIMEOUT_S, "header_timeout_s": HEADER_TIMEOUT_S}


async def tenant_abuse(ctx: Chaos) -> Result:
    """Issue 44's tenant attacks from outside the gateway while a victim tenant streams: no
    5xx, nothing hung or leaked, and the victim's inter-token latency within 2x of unloaded."""
    res, dep, rng = Result("tenants", no_5xx=True), ctx.dep, ctx.rng
    fffd = await asyncio.to_thread(_lone_replacement_token)
    async with AsyncExitStack() as stack:
        http = {t["name"]: await stack.enter_async_context(client(t["name"])) for t in TENANTS}
        unloaded: list[Record] = []
        await asyncio.gather(*(_victim(http["victim"], dep.url, rng, unloaded, UNLOADED_REQUESTS)
                               for _ in range(VICTIM_STREAMS)))
        itl_unloaded = _itl(unloaded)
        stop, during = asyncio.Event(), []
        victims = [asyncio.create_task(_victim(http["victim"], dep.url, rng, during, None, stop))
                   for _ in range(VICTIM_STREAMS)]
        slow = asyncio.create_task(slow_bodies(dep.url, api_key("abuser"), PER_IP_CAP + PAST_THE_CAP))
        t0 = time.monotonic()
        attacks = await asyncio.gather(
            _abuser(res, http, dep.url, rng, ctx.sizes.tenant_waves, (itl_unloaded or 0.05) * VICTIM_TOKENS / 2),
            _sharer(res, http, dep.url, rng, fffd, ctx.sizes.fffd_tokens))
        attacks_s = time.monotonic() - t0
        held: SlowBodies = await slow
        stop.set()
        await asyncio.gather(*victims)
    records = [r for track in attacks for r in track]
    attacked = [r for r in during if r.sent_at < t0 + attacks_s]
    itl_abused = _itl(attacked)
    ratio = None if not (itl_unloaded and itl_abused) else itl_abused / itl_unloaded
    lost = [r for r in unloaded + during if r.outcome is not Outcome.COMPLETED]
    if lost:
        res.broken.append(f"{len(lost)} of the victim's {len(unloaded) + len(during)} streams not served: "
                          f"{sorted({f'{r.status} {r.error[:80]}' for r in lost})}")
    res.broken += held.problems(PER_IP_CAP + PAST_THE_CAP)
    res.failed_cleanly += held.endings["408"] + held.endings["429"]
    res.cancelled += held.endings["closed"]
    if ratio is not None and ratio > ITL_BOUND:
        res.slow.append(f"the victim's inter-token latency was {ratio:.2f}x its unloaded one during the abuse "
                        f"(bound {ITL_BOUND:g}x)")
    res.figures.update(itl_unloaded_ms=_ms(itl_unloaded), itl_abused_ms=_ms(itl_abused),
                       itl_ratio=None if ratio is None else round(ratio, 2), attacks_s=round(attacks_s, 1),
                       victim_streams=[len(unloaded), len(during)], fffd_token=fffd,
                       slow_bodies=dict(held.endings), per_ip_cap=held.cap,
                       slow_body_408_s=None if not held.seconds else round(percentile(held.seconds, 50), 1))
    res.notes.insert(0, f"victim ITL {_ms(itl_unloaded)} ms unloaded, {_ms(itl_abused)} ms under the attacks "
                        f"({'-' if ratio is None else f'{ratio:.2f}'}x; {len(attacked)} streams in "
                        f"{attacks_s:.0f}s); slow bodies {dict(held.endings)} (cap {held.cap})")
    return await settle(ctx, res, records + unloaded + during)


async def _victim(http: httpx.AsyncClient, url: str, rng: random.Random, out: list[Record], count: int | None,
                  stop: asyncio.Event | None = None) -> None:
    """Plain streamed completions one after another: `count` of them, or until `stop`."""
    while (count is None or count > 0) and not (stop is not None and stop.is_set()):
        out.append(await send(http, url, completion(16, VICTIM_TOKENS, rng)))
        count = None if count is None else count - 1


async def _abuser(res: Result, http: dict, url: str, rng: random.Random, waves: int, halfway_s: float) -> list[Record]:
    """Items 2 and 5, one after the other, from the tenant with ABUSER_LIMIT."""
    return (await _left_choices(res, http["abuser"], url, rng, waves, halfway_s)
            + await _schema_flood(res, http, url, waves))


async def _sharer(res: Result, http: dict, url: str, rng: random.Random, fffd: int, fffd_tokens: int) -> list[Record]:
    """Items 1, 7 and 6, one after the other, from the tenants that share their cache (and the isolated ones)."""
    return (await _cache_salts(res, http, url, rng) + await _logprob_bound(res, http["sharer"], url)
            + await _lone_replacement_bias(res, http["sharer"], url, rng, fffd, fffd_tokens))


async def _cache_salts(res: Result, http: dict, url: str, rng: random.Random) -> list[Record]:
    """Item 1: no tenant reads an isolated tenant's prefix cache by spelling its old salt."""
    body = completion(LONG_PROMPT, 2, rng, stream=False)
    cold = await send(http["team/iso"], url, body)
    warm = await send(http["team/iso"], url, body)  # its own cache: the probe's control
    spelled = {"sharer": "tenant:team/iso", "team": "iso"}
    others = {name: await send(http[name], url, {**body, "cache_salt": salt}) for name, salt in spelled.items()}
    records = [cold, warm, *others.values()]
    res.figures["cached_tokens"] = {"team/iso again": _cached(warm),
                                    **{f"{n} salt {s!r}": _cached(others[n]) for n, s in spelled.items()}}
    for r in records:
        if r.outcome is not Outcome.COMPLETED:
            res.broken.append(f"item 1: a {LONG_PROMPT}-token prompt got {r.status}: {r.error[:120]}")
    for name, salt in spelled.items():
        if _cached(others[name]):
            res.broken.append(f"tenant {name} with cache_salt {salt!r} read {_cached(others[name])} cached tokens "
                              "of isolated tenant team/iso")
    return records


async def _left_choices(res: Result, http: httpx.AsyncClient, url: str, rng: random.Random, waves: int,
                        halfway_s: float) -> list[Record]:
    """Item 2: n > 1 requests (streamed and not) filling the tenant's limit, left halfway;
    then its whole limit is served again, and n above it is a 400."""
    records: list[Record] = []
    n, tokens = ABUSER_LIMIT // 2, 64
    for _ in range(waves):
        streamed = {**completion(16, tokens, rng), "n": n}
        whole = {**completion(16, tokens, rng, stream=False), "n": n}
        records += await asyncio.gather(send(http, url, streamed, leave_after_chunks=n * tokens // 2),
                                        send(http, url, whole, leave_after_s=halfway_s))
    full = {**completion(8, 4, rng, stream=False), "n": ABUSER_LIMIT}
    waited_s, t0 = None, time.monotonic()
    while time.monotonic() - t0 < 60.0:  # each left request's slots come back once the gateway sees it gone
        records.append(rec := await send(http, url, full))
        if rec.outcome is Outcome.COMPLETED:
            waited_s = time.monotonic() - t0
            break
        if rec.status != 429:
            break
        await asyncio.sleep(0.5)
    if waited_s is None:
        res.broken.append(f"item 2: n={ABUSER_LIMIT} (the tenant's limit) not served after its requests were "
                          f"left: {records[-1].status} {records[-1].error[:120]}")
    over = await send(http, url, {**full, "n": ABUSER_LIMIT + 1})
    records.append(over)
    if over.status != 400 or over.code != "tenant_concurrency_limit":
        res.broken.append(f"item 2: n={ABUSER_LIMIT + 1}, over the tenant's limit, got {over.status} {over.code}: "
                          f"{over.error[:120]}")
    res.figures["left_choices"] = {"left": sum(r.outcome is Outcome.CANCELLED for r in records),
                                   "full_limit_served_after_s": None if waited_s is None else round(waited_s, 2)}
    return records


def _slow_schema(tag: str) -> dict:
    """A distinct schema (its property's name) that is slow to compile."""
    return {"type": "object", "properties": {tag: {"type": "string", "pattern": "([a-z]{1,20}@){1,20}"}},
            "required": [tag], "additionalProperties": False}


def _schema_request(schema: dict) -> dict:
    return {"model": MODEL, "prompt": "A list of addresses as JSON:", "max_tokens": 16, "temperature": 0.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


async def _schema_flood(res: Result, http: dict, url: str, waves: int) -> list[Record]:
    """Item 5: waves of distinct slow schemas at the abuser's limit, each served or refused
    cleanly; the victim's own uncached schema, sent right after the last wave, is served."""
    run = f"{time.time_ns():x}"  # schemas no earlier run compiled
    records: list[Record] = []
    for wave in range(waves):
        flood = [asyncio.create_task(send(http["abuser"], url, _schema_request(_slow_schema(f"a{run}_{wave}_{i}"))))
                 for i in range(ABUSER_LIMIT)]
        if wave < waves - 1:
            records += await asyncio.gather(*flood)
    own = await send(http["victim"], url, _schema_request({"type": "object", "properties": {
        f"v{run}": {"type": "integer"}}, "required": [f"v{run}"]}))
    records += await asyncio.gather(*flood)
    flooded = records[:]
    records.append(own)
    bad = [r for r in flooded if r.outcome not in (Outcome.COMPLETED, Outcome.FAILED_CLEANLY)
           or (r.status or 0) >= 500]
    if bad:
        res.broken.append(f"item 5: {len(bad)} slow schemas not served or refused cleanly: "
                          f"{sorted({f'{r.status} {r.error[:80]}' for r in bad})}")
    if own.outcome is not Outcome.COMPLETED:
        res.broken.append(f"item 5: the victim's schema after the flood got {own.status}: {own.error[:160]}")
    res.figures["schema_flood"] = {"served": sum(r.status == 200 for r in flooded),
                                   "refused": sorted({f"{r.status} {r.error[:60]}" for r in flooded
                                                      if r.status != 200}), "victim": own.status}
    return records


async def _logprob_bound(res: Result, http: httpx.AsyncClient, url: str) -> list[Record]:
    """Item 7: n = 16, top_logprobs 20, a long max_tokens, not streamed: a 400 naming the bound."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "n": WIDE,
            "logprobs": True, "top_logprobs": 20, "max_tokens": LOGPROB_TOKENS, "stream": False}
    records = await asyncio.gather(*(send(http, url, body, path="/v1/chat/completions") for _ in range(4)))
    for r in records:
        if r.status != 400 or str(MAX_LOGPROB_ENTRIES) not in r.error:
            res.broken.append(f"item 7: n={WIDE} x top_logprobs 20 x {LOGPROB_TOKENS} tokens got {r.status}: "
                              f"{r.error[:160]}")
    return list(records)


async def _lone_replacement_bias(res: Result, http: httpx.AsyncClient, url: str, rng: random.Random,
                                 fffd: int, tokens: int) -> list[Record]:
    """Item 6: logit_bias +100 on a token that decodes to a lone U+FFFD, a long output, streamed."""
    body = {**completion(16, min(tokens, MAX_OUTPUT_TOKENS), rng), "logit_bias": {str(fffd): 100}}
    records = await asyncio.gather(*(send(http, url, body) for _ in range(2)))
    for r in records:
        if r.outcome is not Outcome.COMPLETED:
            res.broken.append(f"item 6: logit_bias on token {fffd} got {r.status}: {r.error[:160]}")
    res.figures["fffd_chunks"] = [r.chunks for r in records]
    return list(records)


def _lone_replacement_token() -> int:
    """A token id of the served model whose text alone is U+FFFD (a byte of a longer character)."""
    from common.model_source import resolve_model
    from common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model(MODEL))
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")


def _cached(rec: Record) -> int:
    return ((rec.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _itl(records: list[Record]) -> float | None:
    """Inter-token latency: the median wait between two text chunks of the streams."""
    return percentile([g for r in records for g in r.gaps_s], 50)


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1000:.0f}"
