"""The decode role of a worker process (also the aggregated mode): its flags and its worker
over a built engine (`python -m decode`, and a process that changes role:
worker/process.py `main`)."""

from __future__ import annotations

import argparse

from common import trace
from decode.kv_source_service import KVSourceService
from decode.service import DecodeService
from decode.unconfirmed_aborts import DEFAULT_ABORT_BOUND_S
from decode.worker import DecodeWorker
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.process import Role, Serving, build_agent, worker_arguments


def arguments() -> argparse.ArgumentParser:
    parser = worker_arguments("decode")
    parser.add_argument("--local-prefill-threshold", type=int, default=0,
                        help="prefill here when the uncached prompt is at most this many tokens")
    parser.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds for one remote prefill")
    parser.add_argument("--abort-bound", type=float, default=DEFAULT_ABORT_BOUND_S,
                        help="seconds a prefill worker may take to confirm an abort (or be proven gone) "
                             "before the request goes on without the blocks it may still be writing")
    parser.add_argument("--no-kv-hand-off", dest="kv_hand_off", action="store_false",
                        help="a drain's hand-off leaves no KV for the taker, which then prefills the handed-off "
                             "requests (the default keeps it for the taker to copy over NIXL)")
    return parser


def build(args: argparse.Namespace, engine: LLMEngine, model: str) -> Serving:
    agent = build_agent("decode", args, engine, model)
    name = agent.name if agent is not None else f"decode-{args.worker_id}"
    trace.set_process("decode", name)
    worker = DecodeWorker(engine, name, agent, args.local_prefill_threshold, args.prefill_timeout,
                          stall_floor_s=args.stall_timeout, abort_bound_s=args.abort_bound,
                          kv_hand_off=args.kv_hand_off)

    def add_servicers(server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeService(worker), server)
        pb_grpc.add_PrefillWorkerServicer_to_server(KVSourceService(worker), server)  # a drain's kept KV

    return Serving(worker, add_servicers)


DECODE = Role("decode", arguments, build)
