"""Every environment variable pdserve reads, typed, in one place (tests/test_layering.py
checks that no other module reads one). Variables pdserve sets for others to read (Ray's
RAY_AUTH_MODE, Triton's TRITON_INTERPRET, a child's PDSERVE_PARENT_PID) are written where
they are needed, under the names defined here."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """PDSERVE_CACHE_DIR: where converted models, the native kernels' library and the dtype
    calibration live (default $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve)."""
    value = os.environ.get("PDSERVE_CACHE_DIR")
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


KERNEL_CHOICES = ("auto", "torch", "triton", "native")


def kernels() -> str:
    """PDSERVE_KERNELS: `auto` (default: Triton on CUDA, native on CPU where it builds, else
    torch), `torch`, `triton` or `native` (CPU: the native op set, or an error); kernels/__init__.py."""
    return _choice("PDSERVE_KERNELS", KERNEL_CHOICES)


def dtype_calibration() -> str:
    """PDSERVE_DTYPE_CALIBRATION: `auto` (default: measure bf16 against float32 only where the
    CPU has no native bf16), `off` (also 0/false/no: the capability rule) or `always`
    (kernels/dtype_choice.py)."""
    value = os.environ.get("PDSERVE_DTYPE_CALIBRATION", "").strip().lower()
    return _choice("PDSERVE_DTYPE_CALIBRATION", ("auto", "off", "always"),
                   "off" if value in ("0", "false", "no") else value)


def cxx() -> str | None:
    """CXX: the C++ compiler that builds the native kernels (default: g++, else c++, on PATH)."""
    return os.environ.get("CXX") or None


INTERNAL_TOKEN = "PDSERVE_INTERNAL_TOKEN"


def internal_token() -> str | None:
    """PDSERVE_INTERNAL_TOKEN: the deployment's shared secret on every internal gRPC call
    (rpc/auth.py); the controller makes one and hands it to every process it starts."""
    return os.environ.get(INTERNAL_TOKEN) or None


INTERNAL_TLS_CA, INTERNAL_TLS_CERT, INTERNAL_TLS_KEY = (
    "PDSERVE_INTERNAL_TLS_CA", "PDSERVE_INTERNAL_TLS_CERT", "PDSERVE_INTERNAL_TLS_KEY")


def internal_tls() -> tuple[bytes, bytes, bytes] | None:
    """PDSERVE_INTERNAL_TLS_CA, _CERT and _KEY: the deployment's CA, and the certificate and
    key it signed, PEM (deploy/internal_ca.py); with all three, internal gRPC is mutual TLS
    (rpc/transport.py). None unless all three are set."""
    values = [os.environ.get(name) for name in (INTERNAL_TLS_CA, INTERNAL_TLS_CERT, INTERNAL_TLS_KEY)]
    if not all(values):
        return None
    ca, cert, key = (v.encode() for v in values)
    return ca, cert, key


def admin_token() -> str | None:
    """PDSERVE_ADMIN_TOKEN: the bearer token of the gateway's admin listener (the controller
    pushes worker lists with it); unset, the gateway serves the workers on its command line."""
    return os.environ.get("PDSERVE_ADMIN_TOKEN") or None


PARENT_PID = "PDSERVE_PARENT_PID"


def parent_pid() -> int | None:
    """PDSERVE_PARENT_PID: the hosting process a worker or gateway ends with
    (common/parent_watch.py); set by deploy/hosts.py for the processes it starts."""
    value = os.environ.get(PARENT_PID, "").strip()
    return int(value) if value else None


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster `pdserve serve` joins (its --address wins); unset, it
    starts one of its own on loopback."""
    return os.environ.get("RAY_ADDRESS") or None


def ray_auth_mode() -> str | None:
    """RAY_AUTH_MODE: Ray's own; `pdserve serve` sets `token` unless told otherwise and warns
    when it is anything else."""
    return os.environ.get("RAY_AUTH_MODE")


def ray_auth_token_path() -> Path:
    """RAY_AUTH_TOKEN_PATH: Ray's own; where its token file is (default ~/.ray/auth_token)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def run_dir() -> Path:
    """Where running processes keep state they share (a gateway's processes' folder):
    <cache dir>/run, never /tmp, whose cleaners remove files a long-lived process still needs."""
    return cache_dir() / "run"


def log_dir() -> Path:
    """PDSERVE_LOG_DIR: where a deployment's processes log, one folder per deployment
    (default <cache dir>/logs; folders 0700, files 0600, rotated by size)."""
    value = os.environ.get("PDSERVE_LOG_DIR")
    return Path(value) if value else cache_dir() / "logs"


def trace_enabled() -> bool:
    """PDSERVE_TRACE: every process on a request's path logs its events (common/trace.py);
    0 / off / false turns them off (default on)."""
    return _flag("PDSERVE_TRACE", True)


def step_metrics_enabled() -> bool:
    """PDSERVE_STEP_METRICS: workers observe each engine step in their metrics (duration,
    tokens, sequences by kind; worker/metrics.py); 0 / off / false turns that off (default on)."""
    return _flag("PDSERVE_STEP_METRICS", True)


def step_log_enabled() -> bool:
    """PDSERVE_STEP_LOG: workers log every engine step's shape and times as a JSON line
    (worker/step_log.py), for `pdserve tune --steps` to fit the step model's contention and
    loop terms from a deployment; 1 / on / true turns it on (default off: a line per step)."""
    return _flag("PDSERVE_STEP_LOG", False)


def _choice(name: str, choices: tuple[str, ...], value: str | None = None) -> str:
    """One of `choices` (the first when unset or blank); a ValueError naming them otherwise."""
    if value is None:
        value = os.environ.get(name, "").strip().lower()
    value = value or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={value!r}: must be 1/on/true or 0/off/false")


FAULT_STALL_FILE = "PDSERVE_FAULT_STALL_FILE"


def fault_stall_file() -> Path | None:
    """PDSERVE_FAULT_STALL_FILE: fault injection for tests and chaos runs. While this file
    exists and is empty, or names the worker (`decode-0-<incarnation>`, or `decode-0` for any
    incarnation of it; whitespace-separated names), the worker's engine loop stalls (its gRPC
    server keeps answering), like a wedged worker, and a starting one waits before its
    warm-up (it never gets ready). So one variable set for a whole deployment can wedge one
    chosen worker. Unset in production."""
    value = os.environ.get(FAULT_STALL_FILE)
    return Path(value) if value else None


FAULT_TRANSFER_FILE = "PDSERVE_FAULT_TRANSFER_FILE"


def fault_transfer_file() -> Path | None:
    """PDSERVE_FAULT_TRANSFER_FILE: fault injection for tests and chaos runs. While this file
    exists, KV pushes follow what it says (transfer/faults.py): `delay_s=2` posts every
    write that much later (a slow link; `delay_s=inf`: a stuck one), `error_rate=0.5` fails
    that share of writes as a broken link would, `only=prefill-0` limits it to that worker
    (any incarnation). Unset in production."""
    value = os.environ.get(FAULT_TRANSFER_FILE)
    return Path(value) if value else None


FAULT_SLOW_FACTOR = "PDSERVE_FAULT_SLOW_FACTOR"


def peer_silence_s() -> float:
    """PDSERVE_PEER_SILENCE_S: how long an internal gRPC peer may stay silent before the calls
    to it fail (rpc/auth.py): keepalive pings every two thirds of it, a third of it to answer
    one (default 15: a ping every 10 s, 5 s to answer; at least 3). A frozen host, or one that
    fell off the network, is noticed within it; raise it where a process may be paused on
    purpose for longer (a debugger, a test that freezes one)."""
    return _number("PDSERVE_PEER_SILENCE_S", 15.0, 3.0, "a number of seconds >= 3")


def fault_slow_factor() -> float:
    """PDSERVE_FAULT_SLOW_FACTOR: fault injection for tests and chaos runs. A factor >= 1 that
    stretches every engine step (and the warm-up step) of every worker to that many times
    its measured duration, by sleeping the difference after it: a slower host, as far as
    the rest of the system can tell (3 makes a step that took 40 ms take 120 ms). Unset or
    1 in production."""
    return _number(FAULT_SLOW_FACTOR, 1.0, 1.0, "a number >= 1")


FAULT_STEP_FLOOR_S = "PDSERVE_FAULT_STEP_FLOOR_S"


def fault_step_floor_s() -> float:
    """PDSERVE_FAULT_STEP_FLOOR_S: fault injection for tests. Seconds that every engine step
    doing work (and the warm-up step) of every worker lasts at least, by sleeping the
    difference after it: steps longer than a deadline on any host, however fast (a factor
    would stretch a fast host's step less and a slow host's far more). Combines with
    PDSERVE_FAULT_SLOW_FACTOR (the longer of the two). Unset or 0 in production."""
    return _number(FAULT_STEP_FLOOR_S, 0.0, 0.0, "a number of seconds >= 0")


FAULT_SLOW_RANK = "PDSERVE_FAULT_SLOW_RANK"


def fault_slow_rank() -> tuple[int, float] | None:
    """PDSERVE_FAULT_SLOW_RANK: fault injection for tests and chaos runs, `RANK:FACTOR`
    (`1:3`). Tensor-parallel rank RANK of every group stretches the compute of each of its
    forward passes (its time outside collectives) to FACTOR times what it measured, by
    sleeping the difference after it: one slow device or core in a group, a straggler the
    others wait for, the same ratio on any host. Unset in production."""
    value = os.environ.get(FAULT_SLOW_RANK, "").strip()
    if not value:
        return None
    rank, _, factor = value.partition(":")
    try:
        parsed = int(rank), float(factor)
    except ValueError:
        parsed = (-1, 0.0)
    if parsed[0] < 0 or not 1 <= parsed[1] < float("inf"):
        raise ValueError(f"{FAULT_SLOW_RANK}={value!r}: expected RANK:FACTOR, a rank >= 0 and a factor >= 1")
    return parsed


def _number(name: str, default: float, low: float, what: str) -> float:
    """A finite float >= `low` from the variable `name`, `default` when unset or blank."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: must be {what}") from None
    if not low <= number < float("inf"):
        raise ValueError(f"{name}={value!r}: must be {what}")
    return number
