"""The scenarios by name, in the order they run: the killers last; the deployment they share
(`SHARED_DEPLOYMENT`) and the one that needs its own (`OWN_DEPLOYMENT`: Deployment's keyword
arguments)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bench.chaos.abuse import BURST_TENANT, abuse
from bench.chaos.client import DEFAULT_TENANT, api_key
from bench.chaos.context import Chaos
from bench.chaos.faults import kill_decode, kill_decode_rank, kill_gateway, kill_prefill, wedged_decode
from bench.chaos.load import overload, storm
from bench.chaos.report import Result
from bench.chaos.sizes import MAX_TTFT_S
from bench.chaos.tenant_abuse import GATEWAY as TENANTS_GATEWAY, TENANTS, tenant_abuse
from bench.chaos.transfer import transfer_error, transfer_error_first, transfer_slow, transfer_stuck

SCENARIOS: dict[str, Callable[[Chaos], Awaitable[Result]]] = {
    "overload": overload,  # on a deployment of its own, with the TTFT bound
    "storm": storm, "abuse": abuse, "tenants": tenant_abuse,  # the rest share one with no bound; killers last
    "transfer-slow": transfer_slow, "transfer-stuck": transfer_stuck, "transfer-error": transfer_error,
    "transfer-error-first": transfer_error_first,
    "wedged": wedged_decode,
    "kill-prefill": kill_prefill, "kill-decode": kill_decode, "kill-gateway": kill_gateway,
    "kill-decode-rank": kill_decode_rank,  # on a deployment of its own, a tensor-parallel decode worker
}

# Shedding is the overload's subject only: the other scenarios test faults, so their
# deployments never shed (a 429 would hide what a fault did to a request). The rank killer's
# has one decode worker of 3 ranks (SmolLM2's 3 KV heads allow 1 or 3): 4 worker processes,
# what a 2-core host carries; with no other decode worker its streams end with an error event.
OWN_DEPLOYMENT: dict[str, dict] = {"overload": {"max_ttft_s": MAX_TTFT_S},
                                   "kill-decode-rank": {"max_ttft_s": None, "decode_replicas": 1, "decode_tp_size": 3}}
# The rest share one (a deployment's start is tens of seconds of the run): two prefill
# workers, so that one of them may fail while the other serves; a tenants file with every
# scenario's tenant (the default one has no limit of its own, as an open gateway's, and shares
# its prefix cache) and a gateway whose limits let each of the tenants scenario's attacks reach
# its bound (a 512-token output cap, a 64 KiB body cap).
SHARED_TENANTS = [{"name": DEFAULT_TENANT, "share_prefix_cache": True}, BURST_TENANT, *TENANTS]
SHARED_DEPLOYMENT: dict = {"max_ttft_s": None, "prefill_replicas": 2, "gateway": TENANTS_GATEWAY,
                           "tenants": [{**t, "api_keys": [api_key(t["name"])]} for t in SHARED_TENANTS]}
