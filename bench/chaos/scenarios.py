"""The scenarios by name, in the order they run: the killers last; and the deployments of
their own that some need (`OWN_DEPLOYMENT`: Deployment's keyword arguments)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bench.chaos.abuse import abuse
from bench.chaos.context import Chaos
from bench.chaos.faults import kill_decode, kill_gateway, kill_prefill, wedged_decode
from bench.chaos.load import overload, storm
from bench.chaos.report import Result
from bench.chaos.sizes import MAX_TTFT_S
from bench.chaos.tenant_abuse import DEPLOYMENT as TENANTS_DEPLOYMENT, tenant_abuse
from bench.chaos.transfer import transfer_error, transfer_error_first, transfer_slow, transfer_stuck

SCENARIOS: dict[str, Callable[[Chaos], Awaitable[Result]]] = {
    "overload": overload,  # on a deployment of its own, with the TTFT bound
    "tenants": tenant_abuse,  # on a deployment of its own, with tenants
    "storm": storm, "abuse": abuse,  # the rest share one with no bound; killers last
    "transfer-slow": transfer_slow, "transfer-stuck": transfer_stuck, "transfer-error": transfer_error,
    "transfer-error-first": transfer_error_first,
    "wedged": wedged_decode,
    "kill-prefill": kill_prefill, "kill-decode": kill_decode, "kill-gateway": kill_gateway,
}

# Shedding is the overload's subject only: the other scenarios test faults, so their
# deployment never sheds (a 429 would hide what a fault did to a request). The tenants'
# attacks need API keys, and a gateway whose limits let each attack reach its bound.
OWN_DEPLOYMENT: dict[str, dict] = {"overload": {"max_ttft_s": MAX_TTFT_S}, "tenants": TENANTS_DEPLOYMENT}
# The rest share one; two prefill workers, so that one of them may fail while the other serves.
SHARED_DEPLOYMENT: dict = {"max_ttft_s": None, "prefill_replicas": 2}
