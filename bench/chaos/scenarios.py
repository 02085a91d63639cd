"""The scenarios by name, in the order they run: the killers last."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bench.chaos.abuse import abuse
from bench.chaos.context import Chaos
from bench.chaos.faults import kill_decode, kill_gateway, kill_prefill, wedged_decode
from bench.chaos.load import overload, storm
from bench.chaos.report import Result
from bench.chaos.transfer import transfer_error, transfer_error_first, transfer_slow, transfer_stuck

SCENARIOS: dict[str, Callable[[Chaos], Awaitable[Result]]] = {
    "overload": overload,  # on a deployment of its own, with the TTFT bound
    "storm": storm, "abuse": abuse,  # the rest share one with no bound; killers last
    "transfer-slow": transfer_slow, "transfer-stuck": transfer_stuck, "transfer-error": transfer_error,
    "transfer-error-first": transfer_error_first,
    "wedged": wedged_decode,
    "kill-prefill": kill_prefill, "kill-decode": kill_decode, "kill-gateway": kill_gateway,
}
