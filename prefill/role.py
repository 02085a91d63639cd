"""The prefill role of a worker process: its flags and its worker over a built engine
(`python -m prefill`, and a process that changes role: worker/process.py `main`)."""

from __future__ import annotations

import argparse

from common import trace
from engine.llm_engine import LLMEngine
from prefill.service import PrefillService
from prefill.worker import PrefillWorker
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.process import Role, Serving, build_agent, worker_arguments


def arguments() -> argparse.ArgumentParser:
    parser = worker_arguments("prefill")
    parser.add_argument("--push-timeout", type=float, default=60.0, help="seconds for one request's KV push")
    return parser


def build(args: argparse.Namespace, engine: LLMEngine, model: str) -> Serving:
    if args.no_transfer:
        raise SystemExit("a prefill worker needs its KV transfer agent (drop --no-transfer)")
    agent = build_agent("prefill", args, engine, model)
    trace.set_process("prefill", agent.name)
    worker = PrefillWorker(engine, agent, args.push_timeout, stall_floor_s=args.stall_timeout)
    return Serving(worker, lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(PrefillService(worker), server))


PREFILL = Role("prefill", arguments, build)
