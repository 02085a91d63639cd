"""The deployment config of `pdserve serve`: the model, the prefill and decode pools, the
gateway and the controller's timings, read from YAML (see deploy/configs/).

Every key is checked: an unknown key is named with its path and the close matches, a wrong
type or an out-of-range value says what was expected, and every message starts with the
source (the file's path), so a typo fails at submit time instead of as a worker that never
starts. Only stdlib and yaml here: the CLI loads this before Ray or torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.front_door.exposure import OPT_IN_FLAG, open_bind_refusal
from gateway.front_door.trusted_proxies import TrustedProxies

DTYPES = ("auto", "bfloat16", "float32", "float16")  # auto: kernels/host.py


class ConfigError(ValueError):
    """A deployment config that cannot be used; the message starts with its source."""


class _Invalid(ConfigError):
    """A problem at a key path (`decode.replicas`), raised before the source is known."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path, self.problem = path, problem


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise _Invalid(key, problem)


def _at_least(config: object, low: float, *keys: str, strict: bool = False) -> None:
    """Each field in keys is None, or >= low (> low when strict)."""
    for key in keys:
        value = getattr(config, key)
        ok = value is None or (value > low if strict else value >= low)
        _require(ok, key, f"must be {'more than' if strict else 'at least'} {low}, got {value}")


@dataclass(frozen=True)
class PoolConfig:
    """One pool of workers ("prefill" or "decode"): how many, what each reserves in Ray,
    and the engine flags each worker process starts with."""

    replicas: int = 1  # prefill: 0 = aggregated (decode workers prefill locally); decode: >= 1
    num_cpus: float = 1.0  # Ray resources reserved per rank (one placement group bundle each)
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker, e.g. {"prefill": 1}
    tp_size: int = 1  # tensor parallelism: ranks per worker, one process and one bundle each, on one node
    kv_blocks: int | None = None  # KV pool size in blocks; None: sized by kv_memory_gib
    kv_memory_gib: float = 1.0
    # The prefix cache's disk tier: each worker keeps the blocks its pool evicts under
    # kv_disk_dir/<role>-<worker id>/ on its node, at most kv_disk_gib; None: off.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 4.0
    threads: int = 1  # torch threads per worker process
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256
    stall_timeout_s: float = 10.0  # floor of each worker's stall bound (worker/liveness.py)
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to `python -m prefill|decode`

    def __post_init__(self) -> None:
        _at_least(self, 0, "replicas", "num_cpus", "num_gpus")
        _at_least(self, 1, "kv_blocks", "threads", "max_num_batched_tokens", "max_num_seqs", "max_waiting",
                  "tp_size")
        _at_least(self, 0, "kv_memory_gib", "kv_disk_gib", "stall_timeout_s", strict=True)
        _require(self.kv_disk_dir is None or bool(self.kv_disk_dir), "kv_disk_dir", "must not be empty")
        _require(self.kv_disk_dir is None or self.tp_size == 1, "kv_disk_dir",
                 f"the disk tier is not supported with tensor parallelism (tp_size={self.tp_size})")
        for name, amount in self.resources.items():
            _require(name not in ("CPU", "GPU"), f"resources.{name}", "use num_cpus / num_gpus instead")
            _require(amount >= 0, f"resources.{name}", f"must be at least 0, got {amount}")

    def worker_args(self) -> list[str]:
        """Flags for `python -m prefill|decode` (the launcher adds --model, --dtype, --port...)."""
        kv = ("--kv-memory-gib", self.kv_memory_gib) if self.kv_blocks is None else ("--kv-blocks", self.kv_blocks)
        tp = ["--tensor-parallel-size", str(self.tp_size)] if self.tp_size > 1 else []
        disk = [] if self.kv_disk_dir is None else ["--kv-disk-dir", self.kv_disk_dir,
                                                    "--kv-disk-gib", str(self.kv_disk_gib)]
        return [kv[0], str(kv[1]), "--threads", str(self.threads), *tp, *disk,
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs), "--max-waiting", str(self.max_waiting),
                "--stall-timeout", str(self.stall_timeout_s), *self.extra_args]

    def bundles(self) -> list[dict[str, float]]:
        """One worker's placement group: a bundle per rank (`num_cpus`, `num_gpus` each;
        the custom `resources` in rank 0's, once per worker), packed on one node."""
        gpus = {"GPU": self.num_gpus} if self.num_gpus > 0 else {}
        rank = {"CPU": self.num_cpus, **gpus}
        return [{**rank, **self.resources}] + [dict(rank) for _ in range(self.tp_size - 1)]

    @property
    def cpus_per_worker(self) -> float:
        return self.num_cpus * self.tp_size


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's flags (named so as not to clash with gateway.app.GatewayConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    tenants: str | None = None  # path to a tenants JSON file; None: open, no keys
    max_ttft_s: float | None = 60.0  # TTFT bound: shed past 75% of it, predicted; None: never shed
    max_output_tokens: int | None = None  # cap on max_tokens; None: the context limit
    max_prompt_tokens: int | None = None  # longer prompts get 413; None: the context limit
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # 408 past them: a client's pause while sending its body (its whole body gets this plus
    # max_body_bytes at 16 KiB/s), and a request head's arrival (gateway/front_door/); None:
    # the gateway's defaults, 30 s and 10 s
    body_timeout_s: float | None = None
    header_timeout_s: float | None = None
    # A request's whole time, first token to last; None: derived per request from its
    # max_tokens and the decode workers' measured step time (gateway/request_path.py).
    request_timeout_s: float | None = None
    # Serve with no tenants file on a non-loopback host: anyone who reaches it can use it.
    insecure_no_api_keys: bool = False
    # Gateway processes on the port, each with its own event loop (one tops out below a
    # decode worker's output at GPU rates); tenant limits and /metrics count across them
    # (gateway/processes.py). `pdserve serve --gateways N` sets it.
    processes: int = 1
    # How the gateway reads its decode workers' tokens: "worker", one Streams call per decode
    # worker carrying every request (one message per engine step); "request", the earlier
    # path, one Generate call per request (kept to compare the two: bench/stream_path.py).
    decode_streams: str = "worker"
    # The Responses API's stored responses (previous_response_id; gateway/responses/store.py):
    # bytes kept at most, one bound for all the processes (0: none stored), and seconds each
    # is kept; None: the gateway's defaults, 64 MiB and one hour.
    response_store_bytes: int | None = None
    response_store_ttl_s: float | None = None
    # Route on the prefix index (gateway/routing/prefix_index.py); False: as before it, to measure against.
    prefix_routing: bool = True
    # Proxies whose X-Forwarded-For names the client (gateway/front_door/trusted_proxies.py): addresses or
    # networks, comma-separated, or "*"; "" (default): none, forwarding headers not believed.
    forwarded_allow_ips: str = ""
    # TLS on the client port (gateway/front_door/tls.py): the certificate chain and its key, PEM files
    # on the gateway's node; None: plain HTTP (put a TLS proxy in front: docs/deploy.md).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.host), "host", "must not be empty")
        _require(self.decode_streams in ("worker", "request"), "decode_streams",
                 f"must be worker or request, got {self.decode_streams!r}")
        _require(open_bind_refusal(self.host, self.tenants is not None, self.insecure_no_api_keys) is None, "host",
                 f"{self.host} with no tenants file would serve anyone who reaches it with no key: set "
                 "gateway.tenants (a JSON file of API keys), bind 127.0.0.1, or set "
                 "gateway.insecure_no_api_keys: true to accept the risk")
        _require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _at_least(self, 0, "max_ttft_s", "request_timeout_s", "response_store_ttl_s", "body_timeout_s",
                  "header_timeout_s", strict=True)
        _at_least(self, 1, "max_output_tokens", "max_prompt_tokens", "max_body_bytes", "processes")
        _at_least(self, 0, "response_store_bytes")
        try:
            TrustedProxies(self.forwarded_allow_ips)
        except ValueError as e:
            _require(False, "forwarded_allow_ips", str(e).removeprefix("--forwarded-allow-ips: "))
        _require(self.ssl_certfile is not None or self.ssl_keyfile is None, "ssl_keyfile",
                 "needs ssl_certfile (the certificate chain, PEM)")

    def args(self) -> list[str]:
        """Flags for `python -m gateway` (the launcher adds --model and the worker addresses)."""
        args = ["--host", self.host, "--port", str(self.port)]
        if self.tenants is not None:
            args += ["--tenants", self.tenants]
        # the gateway's flag has a default of its own, so "never shed" is spelled as an infinite bound
        args += ["--max-ttft", "inf" if self.max_ttft_s is None else str(self.max_ttft_s)]
        if self.max_output_tokens is not None:
            args += ["--max-output-tokens", str(self.max_output_tokens)]
        if self.max_prompt_tokens is not None:
            args += ["--max-prompt-tokens", str(self.max_prompt_tokens)]
        if self.request_timeout_s is not None:
            args += ["--request-timeout", str(self.request_timeout_s)]
        if self.insecure_no_api_keys:
            args.append(OPT_IN_FLAG)
        if self.processes != 1:
            args += ["--processes", str(self.processes)]
        if self.decode_streams != "worker":
            args += ["--decode-streams", self.decode_streams]
        if not self.prefix_routing:
            args.append("--no-prefix-routing")
        if self.response_store_bytes is not None:
            args += ["--response-store-bytes", str(self.response_store_bytes)]
        if self.response_store_ttl_s is not None:
            args += ["--response-store-ttl", str(self.response_store_ttl_s)]
        if self.forwarded_allow_ips:
            args += ["--forwarded-allow-ips", self.forwarded_allow_ips]
        if self.ssl_certfile is not None:
            args += ["--ssl-certfile", self.ssl_certfile]
        if self.ssl_keyfile is not None:
            args += ["--ssl-keyfile", self.ssl_keyfile]
        if self.body_timeout_s is not None:
            args += ["--body-timeout", str(self.body_timeout_s)]
        if self.header_timeout_s is not None:
            args += ["--header-timeout", str(self.header_timeout_s)]
        return args + ["--max-body-bytes", str(self.max_body_bytes)]


@dataclass(frozen=True)
class PlannerConfig:
    """The online planner: moves workers between the pools (their total stays) when the
    observed load would be served better by another split (see deploy/planner/online.py)."""

    enabled: bool = False
    profile: str | None = None  # from `pdserve profile`; required when enabled
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    interval_s: float = 30.0  # how often the load is read and the split reconsidered
    cooldown_s: float = 60.0  # after a change, no other before this
    min_requests: int = 10  # a window with fewer finished requests decides nothing

    def __post_init__(self) -> None:
        _require(not self.enabled or bool(self.profile), "profile", "is required when the planner is enabled "
                 "(make one with `pdserve profile`)")
        _at_least(self, 0, "slo_ttft_s", "slo_tpot_s", "interval_s", strict=True)
        _at_least(self, 0, "cooldown_s")
        _at_least(self, 1, "min_requests")


@dataclass(frozen=True)
class DeployConfig:
    """A whole deployment: what `pdserve serve` starts and how the controller watches it."""

    model: str = "smollm2"  # 'smollm2', a Hugging Face folder or a .gguf file
    served_name: str | None = None  # the name clients use; None: the model folder's name
    dtype: str = "auto"  # bf16 where each worker's CPU computes it natively, else float32
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    health_interval_s: float = 2.0  # the controller's deep-health round
    # A deep health call answers at once (a busy worker is judged on its last step, an
    # idle one probes in milliseconds); one that gets no answer in this time fails.
    health_timeout_s: float = 10.0
    unhealthy_after: int = 3  # consecutive failed rounds (wedged or no answer) before a worker is replaced
    # A draining worker stops once it holds nothing, or wedged; this bounds a drain still
    # making progress (the gateway's request timeout: no request it serves lives longer).
    drain_timeout_s: float = 600.0
    # A drained decode worker hands its requests off (each replayed on another decode worker
    # from the tokens it streamed) instead of finishing them: a drain takes a few steps.
    drain_hand_off: bool = True
    # A move between the pools (the planner's) changes a drained worker's role in its own
    # process, weights kept, when both pools reserve the same bundle (deploy/role_change.py);
    # false: a new worker starts cold and the moved one is drained and stopped.
    move_in_place: bool = True
    ready_timeout_s: float = 300.0  # a worker not ready in this time is a failed start
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    internal_token: str | None = None  # the gRPC shared secret; None: a random one per deployment
    # Mutual TLS on the internal gRPC from a CA the deployment makes at start (rpc/transport.py,
    # deploy/internal_ca.py): "auto" (default) on when `pdserve serve` joins a cluster (gRPC
    # crosses nodes), off for an embedded one (every process on one host's loopback); "on", "off".
    internal_tls: str = "auto"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must not be empty")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.decode.replicas >= 1, "decode.replicas",
                 f"must be at least 1 (decode workers serve every request), got {self.decode.replicas}")
        _at_least(self, 0, "health_interval_s", "health_timeout_s", "ready_timeout_s", strict=True)
        _at_least(self, 0, "drain_timeout_s")
        _at_least(self, 1, "unhealthy_after")
        _require(self.internal_tls in ("auto", "on", "off"), "internal_tls",
                 f"must be auto, on or off, got {self.internal_tls!r}")

    @classmethod
    def from_yaml(cls, path: str | Path) -> DeployConfig:
        """Load a YAML file; an empty file means all defaults."""
        try:
            text = Path(path).read_text()
        except OSError as e:  # missing, a folder, unreadable
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "<config>") -> DeployConfig:
        if isinstance(data, dict) and isinstance(data.get("internal_tls"), bool):  # YAML reads on/off as booleans
            data = {**data, "internal_tls": "on" if data["internal_tls"] else "off"}
        try:
            return _build(cls, data, "")
        except _Invalid as e:
            raise ConfigError(f"{source}: {e}") from None

    def with_overrides(self, **overrides: object) -> DeployConfig:
        """A copy with command-line values applied, validated like a file; None means not given.
        Keys: top-level fields (`model=`), pool fields prefixed by the pool (`prefill_replicas=`,
        `decode_kv_memory_gib=`) and gateway fields bare (`host=`, `port=`)."""
        data = self.to_dict()
        for key, value in overrides.items():
            if value is None:
                continue
            pool, _, name = key.partition("_")
            if pool in ("prefill", "decode") and name:
                data[pool][name] = value
            elif key in data["gateway"]:
                data["gateway"][key] = value
            else:
                data[key] = value
        return DeployConfig.from_dict(data, "overrides")

    def to_dict(self) -> dict:
        """Plain data that from_dict reads back (how the config travels to Ray actors)."""
        return dataclasses.asdict(self)


_EXPECTED = {int: "an integer", float: "a number", str: "a string"}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _build(cls: type, data: object, path: str) -> object:
    """cls from a mapping of its fields, each checked against its annotation."""
    if data is None:  # an empty file, or a section with every key commented out
        data = {}
    if not isinstance(data, dict):
        raise _Invalid(path, f"expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known keys: {', '.join(names)}"
            raise _Invalid(_join(path, key), f"unknown key ({hint})")
    values = {key: _value(value, hints[key], _join(path, key)) for key, value in data.items()}
    try:
        return cls(**values)
    except _Invalid as e:
        raise _Invalid(_join(path, e.path), e.problem) from None


def _value(value: object, hint: object, path: str) -> object:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        (hint,) = (a for a in args if a is not type(None))
        return _value(value, hint, path)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _Invalid(path, f"expected a list, got {value!r}")
        return [_value(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid(path, f"expected a mapping, got {value!r}")
        return {_value(k, args[0], path): _value(v, args[1], _join(path, k)) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise _Invalid(path, f"expected true or false, got {value!r}")
        return value
    if isinstance(value, bool):  # a bool is an int to Python, never to a config
        raise _Invalid(path, f"expected {_EXPECTED[hint]}, got {value!r}")
    if hint is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, hint):
        raise _Invalid(path, f"expected {_EXPECTED[hint]}, got {value!r}")
    return value
