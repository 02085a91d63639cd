"""python -m gateway --decode HOST:PORT [--prefill HOST:PORT ...] [--model smollm2] [--port 8000]

With PDSERVE_ADMIN_TOKEN set in its environment the worker lists may start empty: the
deploy controller pushes them with PUT /admin/workers (Authorization: Bearer <token>) to the
admin socket, 127.0.0.1:--admin-port, which the gateway prints as `admin on HOST:PORT`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import uvicorn

from common import envs, trace
from common.model_source import resolve_model
from common.parent_watch import watch_parent
from gateway import admin_listener
from gateway.app import GatewayConfig, create_app
from gateway.exposure import OPT_IN_FLAG, open_bind_refusal
from gateway.head_deadline import KEEP_ALIVE_S, with_head_timeout
from gateway.metrics import SLO
from gateway.request_path import FIRST_TOKEN_ALLOWANCE_S
from gateway.tenants import Tenants
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
                    help="connections served at once; past it new ones get 503 at once (bounds file descriptors)")
    ap.add_argument("--max-connections-per-ip", type=int, default=None,
                    help="connections one client address may have still sending a request (head or body); past "
                         "it a new one gets 429 and is closed (default: a quarter of --max-connections)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a request may take in all, first token to last (default: derived per request: "
                         f"{FIRST_TOKEN_ALLOWANCE_S:g} s to its first token plus each token it may generate at 10x "
                         "the slowest step the decode workers measured)")
    ap.add_argument("--decode-streams", choices=("worker", "request"), default="worker",
                    help="worker (default): every request on a decode worker streams over one call, one message "
                         "per engine step; request: one Generate call per request (the older path, to measure against)")
    ap.add_argument("--body-timeout", type=float, default=30.0,
                    help="seconds a client may pause while sending its body before a 408")
    ap.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection has to deliver a whole request head (from opening, or from the "
                         "end of its last response) before a 408 and close")
    ap.add_argument("--admin-port", type=int, default=0,
                    help="with PDSERVE_ADMIN_TOKEN: the port of the admin socket, on 127.0.0.1 only (default: any free)")
    ap.add_argument(OPT_IN_FLAG, dest="insecure_no_api_keys", action="store_true",
                    help="serve without API keys on a non-loopback address: anyone who reaches it can use it")
    args = ap.parse_args()
    per_ip = args.max_connections_per_ip
    if per_ip is None:  # a quarter: one address cannot hold every slot, a busy one rarely meets it
        per_ip = max(1, args.max_connections // 4)
    if per_ip < 1:
        ap.error("--max-connections-per-ip must be >= 1")
    refusal = open_bind_refusal(args.host, bool(args.tenants), args.insecure_no_api_keys)
    if refusal:
        ap.error(refusal)
    admin_token = envs.admin_token()
    if not args.decode and not admin_token:
        ap.error("--decode is required (or PDSERVE_ADMIN_TOKEN, for membership pushed by the deploy controller)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trace.set_process("gateway", f"{args.host}:{args.port}")
    if not (args.slo_ttft > 0 and args.slo_tpot > 0):
        ap.error("--slo-ttft and --slo-tpot must be > 0")
    SLO.ttft_s, SLO.tpot_s = args.slo_ttft, args.slo_tpot
    path = resolve_model(args.model)
    name = args.served_name or (args.model if "/" not in args.model else path.name)
    # config.json directly: the gateway never imports torch (engine.config does)
    max_len = json.loads((path / "config.json").read_text()).get("max_position_embeddings", 8192)
    tenants = Tenants.from_file(args.tenants) if args.tenants else Tenants()
    if tenants.open and not is_loopback(args.host):
        logging.getLogger("gateway").warning("serving on %s with no API keys (%s): anyone who reaches it can use it",
                                             args.host, OPT_IN_FLAG)
    admin = admin_listener.bind(args.admin_port) if admin_token else None
    admin_port = admin.getsockname()[1] if admin else None
    config = GatewayConfig(name, path, args.decode, args.prefill, max_len, host=args.host, tenants=tenants,
                           admin_port=admin_port, health_interval_s=args.health_interval, max_ttft_s=args.max_ttft,
                           max_output_tokens=args.max_output_tokens, admin_token=admin_token,
                           max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
                           body_timeout_s=args.body_timeout, request_timeout_s=args.request_timeout,
                           decode_streams=args.decode_streams)
    watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))  # hosted by a Ray actor: end with it
    # Idle keep-alive connections close after 5 s; a request head is capped at 16 KiB (h11) and
    # must arrive within --header-timeout, and one address has at most --max-connections-per-ip
    # connections still sending a request (gateway/head_deadline.py).
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port, log_level="info",
                                           http=with_head_timeout(args.header_timeout, per_ip),
                                           limit_concurrency=args.max_connections, timeout_keep_alive=KEEP_ALIVE_S,
                                           h11_max_incomplete_event_size=16384))
    sockets = [server.config.bind_socket()]
    if admin is not None:
        sockets.append(admin)
        print(f"admin on {admin_listener.HOST}:{admin_port}", file=sys.stderr, flush=True)
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
