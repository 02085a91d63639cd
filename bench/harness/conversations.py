"""Multi-turn chat conversations, for `python -m bench.prefix_reuse`: a seeded workload of
conversations that share a few long system prompts and resend their whole history every
turn (system, the earlier user and assistant turns, a new user message), sent round by
round through /v1/chat/completions with each turn's first token timed.

The text is words drawn from a list of short common English words, one token each under
SmolLM2's tokenizer (400 words are 400 tokens), so a prompt's length is known before it is
sent; the answers' `usage` says what the server counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()


@dataclass(frozen=True)
class Shape:
    """How big the workload is."""

    conversations: int
    turns: int
    system_prompts: int  # distinct system prompts, shared round-robin by the conversations
    system_words: int  # words (tokens) in each system prompt
    user_words: int  # words in each user message
    max_tokens: int  # each answer's length at most (greedy)
    concurrency: int  # turns in flight at once
    pause_s: float = 0.0  # between rounds (the gateway's prefix index learns the workers' blocks every ~2 s)


@dataclass
class Conversation:
    index: int
    system: str
    users: list[str]  # the user message of each turn
    answers: list[str] = field(default_factory=list)  # the assistant's, as they come back

    def messages(self, turn: int) -> list[dict]:
        """What turn `turn` sends: the whole conversation so far and its new user message."""
        out = [{"role": "system", "content": self.system}]
        for user, answer in zip(self.users[:turn], self.answers[:turn]):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": self.users[turn]}]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(shape: Shape, seed: int) -> list[Conversation]:
    """The workload's conversations; conversation i has system prompt i % system_prompts."""
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. {_words(rng, shape.system_words)}" for k in range(shape.system_prompts)]
    return [Conversation(i, systems[i % len(systems)],
                         [f"Question {t + 1}: {_words(rng, shape.user_words)}" for t in range(shape.turns)])
            for i in range(shape.conversations)]


def round_order(count: int, turn: int, seed: int) -> list[int]:
    """The order in which round `turn` sends the conversations' turns: seeded, another each round."""
    order = list(range(count))
    random.Random(seed * 1000 + turn).shuffle(order)
    return order


@dataclass
class Turn:
    """One turn as the client saw it."""

    conversation: int
    turn: int
    prompt_tokens: int = 0  # usage.prompt_tokens
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    header_cached_tokens: int | None = None  # x-pdserve-cached-tokens
    decode_worker: str = ""  # x-pdserve-decode-worker
    prefix_source: str = ""  # x-pdserve-prefix-source: the sibling it fetched prompt blocks from
    prefix_blocks: int = 0  # x-pdserve-prefix-blocks: how many (counted in the cached tokens)
    ttft_s: float | None = None  # send -> the first SSE chunk with content
    e2e_s: float | None = None  # send -> [DONE]
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None and self.e2e_s is not None


def client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def chat_turn(http: httpx.AsyncClient, url: str, model: str, conv: Conversation, turn: int,
                    max_tokens: int) -> Turn:
    """Send turn `turn` of `conv`, streamed and greedy; its record (error set on any failure)."""
    rec = Turn(conv.index, turn)
    body = {"model": model, "messages": conv.messages(turn), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    parts: list[str] = []
    done = False
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            rec.decode_worker = resp.headers.get("x-pdserve-decode-worker", "")
            rec.prefix_source = resp.headers.get("x-pdserve-prefix-source", "")
            rec.prefix_blocks = int(resp.headers.get("x-pdserve-prefix-blocks", 0))
            cached = resp.headers.get("x-pdserve-cached-tokens")
            rec.header_cached_tokens = int(cached) if cached is not None else None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {event['error']}"
                    return rec
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        parts.append(content)
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.text = "".join(parts)
    if not done or rec.ttft_s is None:
        rec.error = "the stream ended before [DONE]" if not done else "no content was streamed"
        return rec
    rec.e2e_s = time.perf_counter() - t0
    return rec


async def run_rounds(url: str, model: str, convs: list[Conversation], shape: Shape, seed: int,
                     say: Callable[[str], None]) -> list[Turn]:
    """Every conversation's turns, round by round: round t sends each conversation's turn t in
    `round_order`, at most `shape.concurrency` in flight, and ends when all have answered (a
    turn's answer is the next turn's assistant message; a failed turn leaves an empty one);
    `shape.pause_s` between rounds."""
    turns: list[Turn] = []
    slots = asyncio.Semaphore(shape.concurrency)
    async with client() as http:
        for t in range(shape.turns):
            if t:
                await asyncio.sleep(shape.pause_s)
            t0 = time.perf_counter()

            async def one(conv: Conversation) -> Turn:
                async with slots:
                    return await chat_turn(http, url, model, conv, t, shape.max_tokens)

            done = await asyncio.gather(*(one(convs[i]) for i in round_order(len(convs), t, seed)))
            for rec in sorted(done, key=lambda r: r.conversation):
                convs[rec.conversation].answers.append(rec.text)
            turns += done
            failed = [r for r in done if not r.ok]
            say(f"  round {t + 1}/{shape.turns}: {len(done)} turns in {time.perf_counter() - t0:.1f}s, "
                f"{sum(r.prompt_tokens for r in done)} prompt tokens, {sum(r.cached_tokens for r in done)} cached"
                + (f", {len(failed)} failed: {failed[0].error}" if failed else ""))
    return turns
