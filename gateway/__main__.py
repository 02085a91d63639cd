"""python -m gateway --decode HOST:PORT [--prefill HOST:PORT ...] [--model smollm2] [--port 8000] [--processes N]

With PDSERVE_ADMIN_TOKEN set in its environment the worker lists may start empty: the
deploy controller pushes them with PUT /admin/workers (Authorization: Bearer <token>) to the
admin socket, 127.0.0.1:--admin-port, which the gateway prints as `admin on HOST:PORT`.

With --processes N > 1 this process is the front process of N gateway processes that share
its sockets (gateway/processes.py); each of them runs this module again with the hidden
flags --shared, --process and --listen-fd (and --admin-fd)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from common import envs, trace
from common.model_source import resolve_model
from common.parent_watch import watch_parent
from gateway import metrics, processes
from gateway.front_door import admin_listener, tls
from gateway.app import GatewayConfig, create_app
from gateway.front_door.exposure import OPT_IN_FLAG, open_bind_refusal
from gateway.front_door.body_limit import MIN_BODY_BYTES_PER_S
from gateway.front_door.head_deadline import KEEP_ALIVE_S, STALL_GRACE_S, with_head_timeout
from gateway.metrics import SLO
from gateway.responses.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES
from gateway.request_path import FIRST_TOKEN_ALLOWANCE_S
from gateway.retry_budget import RetryBudget
from gateway.shared_membership import SharedMembership
from gateway.tenant_table import TenantTable
from gateway.tenants import Tenants
from gateway.front_door.trusted_proxies import TrustedProxies
from rpc.auth import is_loopback


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gateway", description="pdserve OpenAI-compatible gateway")
    ap.add_argument("--model", default="smollm2", help="the model the workers serve (for its tokenizer)")
    ap.add_argument("--served-name", default=None, help="the name clients use (default: the model folder's name)")
    ap.add_argument("--decode", action="append", default=[], help="decode worker address (repeatable)")
    ap.add_argument("--prefill", action="append", default=[], help="prefill worker address (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tenants", help="JSON file of tenants and their API keys (default: open, no keys: one "
                                      "tenant that may run as many sequences as the decode pool holds)")
    ap.add_argument("--health-interval", type=float, default=2.0, help="seconds between deep health rounds")
    ap.add_argument("--max-ttft", type=float, default=60.0,
                    help="the TTFT bound (seconds): answer 429 at once when the predicted time to first token "
                         "passes 75%% of it")
    ap.add_argument("--slo-ttft", type=float, default=SLO.ttft_s,
                    help="seconds: a finished request meets the SLO (pdserve_slo_requests_total) within this TTFT ...")
    ap.add_argument("--slo-tpot", type=float, default=SLO.tpot_s, help="... and this time per output token")
    ap.add_argument("--max-output-tokens", type=int, default=None,
                    help="cap on a request's max_tokens, and its default (default: the context limit)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="longer prompts get 413 (default: the context limit)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    ap.add_argument("--max-connections", type=int, default=1024,
                    help="connections served at once; past it a request gets a JSON 503 at once, its Retry-After "
                         "measured from how fast connections close (bounds file descriptors)")
    ap.add_argument("--max-connections-per-ip", type=int, default=None,
                    help="stalled connections one client address may have: still sending a request (head or body) "
                         f"{STALL_GRACE_S:g} s after it began; past it one more gets a JSON 429 and is closed "
                         "(default: a quarter of --max-connections). Fast requests never count")
    ap.add_argument("--ssl-certfile", default=None,
                    help="serve the client port over TLS alone with this certificate chain (PEM; plain HTTP is "
                         "refused there); the admin socket stays plain on loopback")
    ap.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    ap.add_argument("--forwarded-allow-ips", default="",
                    help="proxies (addresses or networks, comma-separated, or '*') whose X-Forwarded-For names the "
                         "client: the per-address cap and /metrics access then go by that address (default: none, "
                         "forwarding headers are not believed)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a request may take in all, first token to last (default: derived per request: "
                         f"{FIRST_TOKEN_ALLOWANCE_S:g} s to its first token plus each token it may generate at 10x "
                         "the slowest step the decode workers measured)")
    ap.add_argument("--decode-streams", choices=("worker", "request"), default="worker",
                    help="worker (default): every request on a decode worker streams over one call, one message "
                         "per engine step; request: one Generate call per request (the older path, to measure against)")
    ap.add_argument("--no-prefix-routing", dest="prefix_routing", action="store_false",
                    help="route as before the prefix index: rendezvous hash for prefill workers, least outstanding "
                         "tokens for decode workers, no prefix source named (to measure the index against)")
    ap.add_argument("--body-timeout", type=float, default=30.0,
                    help="seconds a client may pause while sending its body before a 408")
    ap.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection has to deliver a whole request head (from opening, or from the "
                         "end of its last response) before a 408 and close")
    ap.add_argument("--response-store-bytes", type=int, default=DEFAULT_MAX_BYTES,
                    help="bytes of stored responses kept for previous_response_id, the oldest of the tenant "
                         "holding the most dropped first; one bound for all the --processes, which may pass it by "
                         "an eighth (default 64 MiB; 0: none stored)")
    ap.add_argument("--response-store-ttl", type=float, default=DEFAULT_MAX_AGE_S,
                    help="seconds a stored response is kept (default one hour)")
    ap.add_argument("--admin-port", type=int, default=0,
                    help="with PDSERVE_ADMIN_TOKEN: the port of the admin socket, on 127.0.0.1 only (default: any free)")
    ap.add_argument(OPT_IN_FLAG, dest="insecure_no_api_keys", action="store_true",
                    help="serve without API keys on a non-loopback address: anyone who reaches it can use it")
    ap.add_argument("--processes", type=int, default=1,
                    help="gateway processes on the port, each with its own event loop; tenant limits and /metrics "
                         "count across them (default 1: this process serves alone)")
    # A child of the front process (gateway/processes.py): where it shares its state, which it
    # is, and the listening sockets it inherited.
    ap.add_argument("--shared", help=argparse.SUPPRESS)
    ap.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--admin-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.processes < 1:
        ap.error("--processes must be >= 1")
    if args.response_store_bytes < 0 or not args.response_store_ttl > 0:
        ap.error("--response-store-bytes must be >= 0 and --response-store-ttl > 0")
    per_ip = args.max_connections_per_ip
    if per_ip is None:  # a quarter: one address cannot hold every slot, a busy one rarely meets it
        per_ip = max(1, args.max_connections // 4)
    if per_ip < 1:
        ap.error("--max-connections-per-ip must be >= 1")
    tls_refusal = tls.check_files(args.ssl_certfile, args.ssl_keyfile)
    if tls_refusal:
        ap.error(tls_refusal)
    try:
        proxies = TrustedProxies(args.forwarded_allow_ips)
    except ValueError as e:
        ap.error(str(e))
    refusal = open_bind_refusal(args.host, bool(args.tenants), args.insecure_no_api_keys)
    if refusal:
        ap.error(refusal)
    admin_token = envs.admin_token()
    if not args.decode and not admin_token:
        ap.error("--decode is required (or PDSERVE_ADMIN_TOKEN, for membership pushed by the deploy controller)")
    if not (args.slo_ttft > 0 and args.slo_tpot > 0):
        ap.error("--slo-ttft and --slo-tpot must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.processes > 1 and args.shared is None:
        sys.exit(_front(args, admin_token))
    shared = processes.SharedFolder(Path(args.shared)) if args.shared else None
    if shared is not None:  # before any request is counted
        metrics.count_across_processes(shared.metrics)
    trace.set_process("gateway", f"{args.host}:{args.port}")
    SLO.ttft_s, SLO.tpot_s = args.slo_ttft, args.slo_tpot
    path = resolve_model(args.model)
    name = args.served_name or (args.model if "/" not in args.model else path.name)
    # config.json directly: the gateway never imports torch (engine.config does)
    max_len = json.loads((path / "config.json").read_text()).get("max_position_embeddings", 8192)
    try:
        tenants = Tenants.from_file(args.tenants) if args.tenants else Tenants()
    except (OSError, ValueError, TypeError) as e:  # a malformed file: say what, not a traceback
        ap.error(f"--tenants {args.tenants}: {e}")
    budget = RetryBudget()
    if shared is not None:  # a row per tenant, then the retry budget's
        table = TenantTable.open(shared.counts, len(tenants.all()) + 1, args.processes, args.process)
        tenants.share(table)
        budget.share(table.row(table.rows - 1))
    if tenants.open and not is_loopback(args.host):
        logging.getLogger("gateway").warning("serving on %s with no API keys (%s): anyone who reaches it can use it",
                                             args.host, OPT_IN_FLAG)
    if args.admin_fd is not None:
        admin = socket.socket(fileno=args.admin_fd)
    else:
        admin = admin_listener.bind(args.admin_port) if admin_token else None
    admin_port = admin.getsockname()[1] if admin else None
    config = GatewayConfig(name, path, args.decode, args.prefill, max_len, host=args.host, tenants=tenants,
                           admin_port=admin_port, health_interval_s=args.health_interval, max_ttft_s=args.max_ttft,
                           max_output_tokens=args.max_output_tokens, admin_token=admin_token,
                           max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
                           body_timeout_s=args.body_timeout, request_timeout_s=args.request_timeout,
                           decode_streams=args.decode_streams, response_store_bytes=args.response_store_bytes,
                           response_store_ttl_s=args.response_store_ttl,
                           response_store_folder=shared.responses if shared is not None else None,
                           processes=args.processes, prefix_routing=args.prefix_routing, trusted_proxies=proxies,
                           retry_budget=budget)
    watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))  # hosted by a Ray actor: end with it
    # Idle keep-alive connections close after 5 s; a request head is capped at 16 KiB (h11) and
    # must arrive within --header-timeout, and one address has at most --max-connections-per-ip
    # stalled connections (gateway/front_door/head_deadline.py). uvicorn's own proxy headers are off: who
    # the client is comes from --forwarded-allow-ips alone (gateway/front_door/trusted_proxies.py). The
    # asyncio loop, named: it reads pending bytes before it runs a timer due in the same turn.
    app = create_app(config)
    if shared is not None and admin is not None:  # a push one process takes reaches the others
        app = SharedMembership(app, shared.membership, admin_port, admin_token)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            http=with_head_timeout(args.header_timeout, per_ip, proxies,
                                                   body_deadline_s=args.body_timeout
                                                   + args.max_body_bytes / MIN_BODY_BYTES_PER_S,
                                                   max_connections=args.max_connections),
                            loop="asyncio", proxy_headers=False, ssl_certfile=args.ssl_certfile,
                            ssl_keyfile=args.ssl_keyfile,
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=16384)
    # the client port (TLS when asked), and the admin socket beside it, plain on loopback
    server = tls.Server(config, plain=[admin] if admin is not None else [])
    client = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else config.bind_socket()
    if admin is not None and shared is None:  # the front process says it for its children
        print(f"admin on {admin_listener.HOST}:{admin_port}", file=sys.stderr, flush=True)
    server.run(sockets=[client])


def _front(args: argparse.Namespace, admin_token: str | None) -> int:
    """The front process of `args.processes` gateway processes: the sockets bound once and
    the model resolved once (a conversion runs once, not in every child), then
    gateway/processes.py; returns the exit code."""
    path = resolve_model(args.model)
    name = args.served_name or (args.model if "/" not in args.model else path.name)
    client = uvicorn.Config(app=None, host=args.host, port=args.port).bind_socket()
    sockets = [client]
    if admin_token:
        sockets.append(admin_listener.bind(args.admin_port))
    for s in sockets:  # connections queue from now on, also while a child restarts
        s.listen(processes.BACKLOG)
    port = client.getsockname()[1]
    if admin_token:
        print(f"admin on {admin_listener.HOST}:{sockets[1].getsockname()[1]}", file=sys.stderr, flush=True)

    def child_args(folder: processes.SharedFolder, index: int, fds: list[int]) -> list[str]:
        # the same flags, then what the front process settled (a later flag wins)
        settled = ["--model", str(path), "--served-name", name, "--port", str(port), "--shared", str(folder.path),
                   "--process", str(index), "--listen-fd", str(fds[0])]
        if admin_token:
            settled += ["--admin-fd", str(fds[1])]
        if args.tenants:
            settled += ["--tenants", str(folder.tenants)]
        return [*sys.argv[1:], *settled]

    return processes.serve(args.processes, sockets, args.tenants, child_args)


if __name__ == "__main__":
    main()
