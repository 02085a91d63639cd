"""Faults, overload and abuse against the real system: `python -m bench.chaos`.

Starts `pdserve serve` (embedded Ray, SmolLM2 in bfloat16, 2 decode workers) as a subprocess
and runs the scenarios against it one after another (docs/chaos.md says what each does): the
overload on a deployment of its own (1 prefill worker) whose gateway sheds past a TTFT bound,
the kill -9 of a tensor-parallel rank on one whose one decode worker has 3 ranks, the others
on one (2 prefill workers) that never sheds and has a tenants file, so every request carries
a tenant's API key. It prints one row per scenario:

- completed: HTTP 200 and a finished answer (a stream: a finish_reason, then [DONE]);
- failed cleanly: an OpenAI-shaped JSON error (429 shed, 503 no worker, ...), or an SSE
  error event followed by [DONE];
- dropped: a transport error, a stream cut before [DONE] or an error body that is not
  JSON; expected only when the gateway process itself is killed;
- hung: silent for the client's timeout: no answer, or a stream with no event that long
  (must be 0; a stream that keeps giving tokens is slow, not hung);
- leaked blocks: once every worker is back and idle, KV blocks not free, summed over the
  workers (Stats over the internal gRPC; must be 0);
- recovery s: from the fault until a fresh request succeeds again.

    python -m bench.chaos [--only storm,kill-decode] [--quick] [--json out.json]

As root, run it in a loopback-only network namespace (embedded Ray binds to the node's address):
    unshare -n -- sh -c 'ip link set lo up && OMP_NUM_THREADS=1 .venv/bin/python -m bench.chaos'

The package, one concept a module: `sizes` (the constants and the scenario sizes),
`report` (how a request ended, a scenario's result, the table), `client` (the HTTP client
that classifies every answer, and the tenants' API keys), `deployment` (`pdserve serve` as a
subprocess; `status_feed`, its status from one Ray driver), `context`
(what every scenario gets, and `settle` after it), the scenarios in `faults`, `transfer`, `load`
`abuse` and `tenant_abuse` (with `slow_bodies`), their order and deployments in `scenarios`, and the command line in `cli`.
"""

from __future__ import annotations

from bench.chaos.abuse import abuse, fuzz, half_read
from bench.chaos.cli import main
from bench.chaos.client import client, completion, recover, send, until
from bench.chaos.context import Chaos, settle
from bench.chaos.deployment import BIN, REPO, Deployment, free_port
from bench.chaos.faults import kill_decode, kill_decode_rank, kill_gateway, kill_prefill, wedged_decode
from bench.chaos.load import LEAVE_KINDS, overload, storm
from bench.chaos.report import Outcome, Record, Result, table
from bench.chaos.scenarios import OWN_DEPLOYMENT, SCENARIOS, SHARED_DEPLOYMENT
from bench.chaos.tenant_abuse import tenant_abuse
from bench.chaos.transfer import transfer_error, transfer_slow, transfer_stuck
from bench.chaos.sizes import (CLIENT_TIMEOUT_S, FULL, KV_BLOCKS, MAX_OUTPUT_TOKENS, MAX_TTFT_S, MODEL, QUICK,
                               RECOVERY_TIMEOUT_S, TOKENS, Sizes)

__all__ = [
    "BIN", "CLIENT_TIMEOUT_S", "FULL", "KV_BLOCKS", "LEAVE_KINDS", "MAX_OUTPUT_TOKENS", "MAX_TTFT_S", "MODEL", "QUICK",
    "OWN_DEPLOYMENT", "RECOVERY_TIMEOUT_S", "REPO", "SCENARIOS", "SHARED_DEPLOYMENT", "TOKENS", "Chaos", "Deployment", "Outcome", "Record", "Result",
    "Sizes", "abuse", "client", "completion", "free_port", "fuzz", "half_read", "kill_decode", "kill_decode_rank",
    "kill_gateway", "kill_prefill", "main", "overload", "recover", "send", "settle", "storm", "table", "tenant_abuse",
    "transfer_error", "transfer_slow", "transfer_stuck", "until", "wedged_decode",
]
