"""python -m prefill --port P [--model M] ...: a prefill worker process."""

from __future__ import annotations

import logging

from engine import trace
from prefill.service import PrefillService
from prefill.worker import PrefillWorker
from rpc import pdserve_pb2_grpc as pb_grpc
from worker.process import build_agent, build_engine, serve, worker_arguments


def main() -> None:
    parser = worker_arguments("prefill")
    parser.add_argument("--push-timeout", type=float, default=60.0, help="seconds for one request's KV push")
    args = parser.parse_args()
    if args.no_transfer:
        parser.error("a prefill worker needs its KV transfer agent")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, model = build_engine(args)
    agent = build_agent("prefill", args, engine, model)
    trace.set_process("prefill", agent.name)
    worker = PrefillWorker(engine, agent, args.push_timeout, stall_floor_s=args.stall_timeout)
    serve(worker, lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(PrefillService(worker), server),
          args.host, args.port)


if __name__ == "__main__":
    main()
