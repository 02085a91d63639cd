"""The constants every scenario shares, and how big each scenario is (full, or --quick)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "smollm2"
KV_BLOCKS = 512  # per worker (16 tokens each): small enough that the overload presses on it
MAX_TTFT_S = 4.0  # the gateway's admission bound (gateway.max_ttft_s)
MAX_OUTPUT_TOKENS = 256  # the gateway's cap on max_tokens: keeps fuzzed requests short
TOKENS = range(1000, 40000)  # prompt token ids: plain vocabulary, no special tokens
CLIENT_TIMEOUT_S = 120.0  # a request silent this long (no headers, then no SSE event) is hung
RECOVERY_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is: the full run, and --quick (tests/e2e/test_chaos.py)."""

    storm: int  # requests in the cancellation storm, 30% of them left by their client
    storm_concurrency: int
    storm_prompt: int  # storm prompts: 8 to this many tokens
    storm_output: int  # storm outputs: 2 to this many tokens
    streams: int  # requests in flight when a process is killed
    stream_tokens: int  # their output tokens
    long_prompt: int  # tokens per prompt in transfer when the prefill worker dies
    probe_s: float  # the closed-loop capacity probe before the overload
    overload_s: float  # open loop at 5x that capacity
    fuzz_examples: int  # per schemathesis mode, and for the hypothesis bodies and headers
    half_reads: int  # raw connections that stop reading (or sending) halfway
    abuse_rounds: int  # the gateway's RSS is read after each: growth past the first round is a leak
    health_interval_s: float  # the controller's rounds
    unhealthy_after: int  # failed deep checks before a wedged worker is replaced
    transfer_requests: int  # long prompts sent at once through each KV-transfer fault
    prefill_timeout_s: float  # the decode workers' --prefill-timeout: how long a stuck transfer lasts
    tenant_waves: int  # the tenants scenario's rounds of requests left halfway, and of slow schemas
    fffd_tokens: int  # the tenants scenario's lone-U+FFFD streams: output tokens (many times MAX_HELD)
    retry_storm_s: float  # the overload's retry storm: clients resending every 429 at once, this long


FULL = Sizes(1000, 48, 128, 16, 16, 128, 800, 10.0, 20.0, 100, 48, 2, 2.0, 3, 8, 15.0, 4, 512, 15.0)
# --quick: the fuzzing mostly tests/gateway/test_gateway_fuzz.py's (here: on a real deployment, fewer)
QUICK = Sizes(100, 32, 128, 16, 8, 64, 400, 5.0, 6.0, 10, 12, 1, 1.0, 2, 4, 8.0, 2, 128, 4.0)
