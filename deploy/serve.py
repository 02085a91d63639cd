"""`pdserve serve`, `pdserve scale`, `pdserve status`: the deployment's driver and its admin.

`serve` prepares the model, joins a Ray cluster (RAY_ADDRESS or --address, as under
`ray job submit`) or starts an embedded one on this machine, starts the controller (a
named actor), prints its progress until the gateway serves, and on Ctrl-C or SIGTERM
stops the gateway, the workers and, if it started it, Ray: no process outlives it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time

# Ray's token auth, always (before Ray is imported; every Ray process inherits it): an open
# Ray runs anyone's code through its job-submission API. Ray finds the token as it
# documents (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, which an embedded
# cluster's first start writes), so `pdserve status` and `scale` on this machine need
# nothing more. Only a test's own loopback sandbox sets RAY_AUTH_MODE=disabled.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from common import envs  # noqa: E402
from deploy.config import ConfigError, DeployConfig  # noqa: E402
from gateway.front_door import tls  # noqa: E402

CONTROLLER, NAMESPACE = "pdserve-controller", "pdserve"


def add_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the whole system (embedded Ray, or join a cluster)")
    serve.add_argument("--config", help="deployment YAML (see deploy/configs/); flags below override it")
    serve.add_argument("--model", help="'smollm2' (default), a Hugging Face folder or a .gguf file")
    serve.add_argument("--dtype", help="auto (default: bfloat16 where the CPU computes it natively, "
                       "else float32), bfloat16, float32 or float16")
    serve.add_argument("--prefill", type=int, help="prefill workers (default 1; 0 = aggregated)")
    serve.add_argument("--decode", type=int, help="decode workers (default 1)")
    serve.add_argument("--prefill-tp", type=int, help="tensor-parallel ranks per prefill worker (YAML prefill.tp_size)")
    serve.add_argument("--decode-tp", type=int, help="tensor-parallel ranks per decode worker (YAML decode.tp_size)")
    serve.add_argument("--kv-disk-dir", help="the prefix cache's disk tier: each worker keeps the blocks its pool "
                       "evicts under DIR/<role>-<worker id>/ on its node (YAML prefill/decode.kv_disk_dir)")
    serve.add_argument("--kv-disk-gib", type=float, help="each worker's disk tier bound (default 4; YAML kv_disk_gib)")
    serve.add_argument("--no-prefix-routing", dest="prefix_routing", action="store_const", const=False,
                       help="route as before the prefix index (YAML gateway.prefix_routing: false), to measure "
                            "against")
    serve.add_argument("--host", help="gateway address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gateway port (default 8000)")
    serve.add_argument("--ssl-certfile", help="serve the gateway over TLS with this certificate chain (PEM; "
                       "YAML gateway.ssl_certfile): every gateway process, plain HTTP refused on its port")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key (PEM; YAML gateway.ssl_keyfile)")
    serve.add_argument("--gateways", type=int, help="gateway processes on that port (default 1; "
                       "YAML gateway.processes): one per event loop, tenant limits and /metrics across them")
    serve.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded one)")
    serve.add_argument("--num-cpus", type=int, help="CPUs the embedded Ray offers (default: enough for the pools)")
    serve.set_defaults(run=run_serve)

    scale = sub.add_parser("scale", help="resize the pools of a running deployment")
    scale.add_argument("--prefill", type=int)
    scale.add_argument("--decode", type=int)
    scale.add_argument("--address", help="the deployment's Ray cluster (default: RAY_ADDRESS, else 'auto')")
    scale.set_defaults(run=run_scale)

    status = sub.add_parser("status", help="the workers of a running deployment")
    status.add_argument("--address", help="the deployment's Ray cluster (default: RAY_ADDRESS, else 'auto')")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(run=run_status)


def _say(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)


def _check_ray_auth() -> None:
    if envs.ray_auth_mode() != "token":
        _say(f"WARNING: RAY_AUTH_MODE={envs.ray_auth_mode()}: Ray's APIs take anyone's code on this "
             "cluster's ports; use token auth (unset it) outside a sandbox")


def _private_ray_token() -> None:
    """Ray writes its default token file readable by all; only its owner needs it."""
    path = envs.ray_auth_token_path()
    try:
        if path.is_file():
            path.chmod(0o600)
    except OSError:
        pass


def _embedded_on_loopback() -> None:
    """An embedded cluster is this machine's alone: every Ray process (GCS, raylet, dashboard
    agent, workers) and every pdserve worker binds 127.0.0.1, not the node's address or every
    interface. Ray's switch for a one-machine cluster, read when Ray is imported and inherited
    by each process it starts (workers then take 127.0.0.1 as their node's address)."""
    assert "ray" not in sys.modules, "set before Ray is imported"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def load_config(args: argparse.Namespace) -> DeployConfig:
    config = DeployConfig.from_yaml(args.config) if args.config else DeployConfig()
    config = config.with_overrides(model=args.model, dtype=args.dtype, prefill_replicas=args.prefill,
                                   decode_replicas=args.decode, prefill_tp_size=args.prefill_tp,
                                   decode_tp_size=args.decode_tp, host=args.host, port=args.port,
                                   processes=args.gateways, prefix_routing=args.prefix_routing,
                                   prefill_kv_disk_dir=args.kv_disk_dir, decode_kv_disk_dir=args.kv_disk_dir,
                                   prefill_kv_disk_gib=args.kv_disk_gib, decode_kv_disk_gib=args.kv_disk_gib,
                                   ssl_certfile=_absolute(args.ssl_certfile), ssl_keyfile=_absolute(args.ssl_keyfile))
    g = config.gateway
    if g.ssl_certfile is not None:  # read here: a wrong file fails now, and actors get absolute paths
        certfile, keyfile = _absolute(g.ssl_certfile), _absolute(g.ssl_keyfile)
        refusal = tls.check_files(certfile, keyfile)
        if refusal:
            raise ConfigError(f"gateway.ssl_certfile/ssl_keyfile: {refusal}")
        config = config.with_overrides(ssl_certfile=certfile, ssl_keyfile=keyfile)
    if config.planner.enabled:  # read here: a bad profile fails now, and actors get an absolute path
        from deploy.planner.profile import Profile

        try:
            Profile.load(config.planner.profile)
        except ValueError as e:
            raise ConfigError(f"planner.profile: {e}") from None
        data = config.to_dict()
        data["planner"]["profile"] = os.path.abspath(config.planner.profile)
        config = DeployConfig.from_dict(data, args.config or "<flags>")
    return config


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ConfigError as e:
        _say(str(e))
        return 2
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    from common.model_source import resolve_model

    t0 = time.monotonic()
    _say(f"preparing model {config.model} (converted once, then cached)")
    try:
        path = resolve_model(config.model)
    except (ValueError, FileNotFoundError) as e:
        _say(str(e))
        return 1
    _say(f"model ready in {time.monotonic() - t0:.1f}s: {path}")
    if config.dtype == "auto":
        from kernels.dtype_choice import auto_dtype  # measured once per host kind, cached for the workers
        from kernels.host import cpu

        dtype, why = auto_dtype()
        _say(f"dtype auto: {str(dtype).removeprefix('torch.')} on this host, because {why} [{cpu().describe()}]; "
             f"each worker chooses on its own node and logs it")
    else:
        _say(f"dtype {config.dtype} (as configured)")

    address = args.address or envs.ray_address()
    if not address:
        _embedded_on_loopback()
    import ray

    _check_ray_auth()
    if address:
        _say(f"joining the Ray cluster at {address}")
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    else:
        pools = (config.prefill.replicas * config.prefill.cpus_per_worker
                 + config.decode.replicas * config.decode.cpus_per_worker)
        cpus = args.num_cpus or max(os.cpu_count() or 1, int(pools + 0.999))
        _say(f"starting an embedded Ray with {cpus} CPUs")
        ray.init(address="local", num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
    _private_ray_token()
    for sig in (signal.SIGINT, signal.SIGTERM):  # ray.init installs its own (which exits at once)
        signal.signal(sig, on_signal)
    _say(f"Ray cluster at {ray.get_runtime_context().gcs_address} (pdserve status/scale --address ...)")
    if config.internal_tls == "auto":  # mutual TLS where gRPC crosses nodes
        config = config.with_overrides(internal_tls="on" if address else "off")
    _say("internal gRPC: mutual TLS from a CA made for this deployment" if config.internal_tls == "on" else
         "internal gRPC: plain, on this host's loopback (internal_tls: on to encrypt it anyway)" if not address else
         "internal gRPC: plain (internal_tls: off); the internal token is its only check")
    try:
        return _run(ray, config, stop)
    finally:
        ray.shutdown()


def _run(ray, config: DeployConfig, stop: threading.Event) -> int:
    from deploy.controller import ControllerActor

    try:
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        _say("a pdserve deployment already runs on this cluster (pdserve status); not starting another")
        return 1
    except ValueError:
        pass
    controller = ControllerActor.options(name=CONTROLLER, namespace=NAMESPACE).remote(
        config.to_dict(), secrets.token_urlsafe(24), config.internal_token or secrets.token_urlsafe(24),
        ray.get_runtime_context().get_node_id())
    code, seen = 0, 0
    try:
        started = controller.start.remote()
        while not stop.is_set():
            done, _ = ray.wait([started], timeout=0.5)
            seen = _print_events(ray, controller, seen)
            if done:
                break
        if not stop.is_set():
            status = ray.get(started)
            _say(f"serving {config.model} at {status['gateway']}/v1 (Ctrl-C stops everything)")
            while not stop.wait(1.0):
                seen = _print_events(ray, controller, seen)
    except Exception as e:  # a worker or the gateway could not start: say why, then clean up
        _say(f"failed: {e}")
        code = 1
    _say("stopping")
    try:  # how long the workers' own shutdowns may take, from their stall bounds
        bound = ray.get(controller.shutdown_bound_s.remote(), timeout=30)
    except Exception:  # the shutdown is still asked for; Ray ends what it has not stopped by then
        bound = 120.0
    try:
        ray.get(controller.shutdown.remote(), timeout=bound)
    except Exception as e:
        _say(f"clean-up incomplete: {e}")
        code = code or 1
    _print_events(ray, controller, seen)
    ray.kill(controller)
    return code


def _print_events(ray, controller, seen: int) -> int:
    try:
        events = ray.get(controller.events_since.remote(seen), timeout=10)
    except Exception:
        return seen
    for line in events:
        _say(line)
    return seen + len(events)


def _connect(args: argparse.Namespace):
    import ray

    ray.init(address=args.address or envs.ray_address() or "auto", namespace=NAMESPACE,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        return ray, ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise SystemExit("pdserve: no pdserve deployment runs on this Ray cluster") from None


def run_scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:
        raise SystemExit("pdserve scale: give --prefill N and/or --decode N")
    ray, controller = _connect(args)
    try:
        status = ray.get(controller.scale.remote(args.prefill, args.decode))
    except Exception as e:
        _say(f"scaling failed: {e}")
        return 1
    _print_status(status)
    return 0


def run_status(args: argparse.Namespace) -> int:
    ray, controller = _connect(args)
    status = ray.get(controller.status.remote(), timeout=30)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        _print_status(status)
    return 0


def _print_status(status: dict) -> None:
    print(f"gateway  {status['gateway']}")
    for role, slots in status["pools"].items():
        print(f"{role:8} {len(slots)} worker(s)")
        for s in slots:
            print(f"  {s['worker_id']:>3}  {s['state']:10} {s['address']:22} incarnation {s['incarnation']}  "
                  f"restarts {s['restarts']}  node {s['node_id'][:12]}")
            if s.get("straggler"):
                print(f"       slow tensor-parallel rank: {s['straggler']}")
    for s in status.get("starting", []):  # placed by a scale in progress, not ready yet
        print(f"starting {s['role']} worker {s['worker_id']} (loading)")
