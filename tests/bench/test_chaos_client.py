"""The chaos client's verdict on a long request (bench/chaos/client.py): hung means silent for
the client's timeout, not long. A stream that keeps giving events outlives the timeout and
is not hung; one that goes silent is, and is cancelled."""

from __future__ import annotations

import asyncio
import time

from bench.chaos.client import heard_within
from bench.chaos.report import Record

SILENCE_S = 2.0  # far above any pause of this process's own event loop between two ticks
TICK_S = 0.01


async def _talking(rec: Record, for_s: float) -> None:
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        rec.heard_at = time.monotonic()
        await asyncio.sleep(TICK_S)


def test_a_stream_that_keeps_talking_past_the_timeout_is_not_hung():
    rec = Record()
    assert asyncio.run(heard_within(_talking(rec, SILENCE_S * 1.5), rec, SILENCE_S))


def test_a_silent_exchange_is_hung_and_cancelled():
    rec, cancelled = Record(), []

    async def silent_after_a_while() -> None:
        await _talking(rec, 0.1)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    assert not asyncio.run(heard_within(silent_after_a_while(), rec, SILENCE_S))
    assert cancelled


def test_an_exchange_that_fails_raises():
    async def failing() -> None:
        raise ValueError("boom")

    try:
        asyncio.run(heard_within(failing(), Record(), SILENCE_S))
    except ValueError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("the exchange's error was swallowed")
