"""The `Worker` gRPC service both roles answer the same way: TransferInfo, Health, Stats,
Metrics, Drain, ChangeRole.
Registered by worker/process.py next to the role's own service, on the same port."""

from __future__ import annotations

import grpc
from prometheus_client import REGISTRY, generate_latest

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.convert import health_to_pb, kv_events_to_pb, stats_to_pb
from worker.role_change import RoleChange, RoleChanges

# An idle worker's probe is one token through the loop, which picks it up within a
# millisecond; past this wait (or the call's deadline) the loop's own heartbeat decides.
DEEP_HEALTH_PROBE_WAIT_S = 5.0


class WorkerService(pb_grpc.WorkerServicer):
    """For an EngineLoop with `name`, `agent` and `kv_blocks_transferred`; `role_changes`
    where the process can serve either role (None: ChangeRole is not implemented)."""

    def __init__(self, worker, role_changes: RoleChanges | None = None):
        self.worker = worker
        self.role_changes = role_changes

    def TransferInfo(self, request: pb.TransferInfoRequest, context: grpc.ServicerContext) -> pb.TransferInfoResponse:
        agent = self.worker.agent
        if agent is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.worker.name} runs without KV transfer")
        return pb.TransferInfoResponse(info=agent.info().to_bytes())

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        if not request.deep:
            return pb.HealthResponse(ok=True, worker=self.worker.name)
        remaining = context.time_remaining()
        wait = DEEP_HEALTH_PROBE_WAIT_S if remaining is None else min(DEEP_HEALTH_PROBE_WAIT_S, remaining - 0.1)
        return health_to_pb(self.worker.name, self.worker.health(wait))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        # Plain reads of counters the loop thread updates: each is consistent on its own.
        w = self.worker
        stats = stats_to_pb(w.name, w.engine.stats(), w.last_step_seconds, w.kv_blocks_transferred,
                            w.liveness.prefill_tokens_per_s, w.num_probes)
        sched = w.engine.config.scheduler  # what it holds at most: the gateway sizes open tenants by it
        stats.max_num_seqs = sched.max_num_seqs
        stats.max_waiting = sched.max_waiting or 0  # a worker process always bounds it (--max-waiting)
        if request.kv_events:  # a cursor of another incarnation means nothing here: a resync
            cursor = request.kv_events_after if request.kv_events_of == w.name else None
            stats.kv_events.CopyFrom(kv_events_to_pb(w.kv_events.since(cursor, request.kv_events_resync_after)))
        return stats

    def Metrics(self, request: pb.MetricsRequest, context: grpc.ServicerContext) -> pb.MetricsResponse:
        name = self.worker.name
        return pb.MetricsResponse(worker=name, role=name.split("-", 1)[0], exposition=generate_latest(REGISTRY))

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        """No new request from now on; what is still held, counted on the loop (worker/holdings.py)."""
        try:
            h = self.worker.drain(request.hand_off)
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{self.worker.name}: the engine loop did not answer within {self.worker.loop_wait_s():.0f}s")
        return pb.DrainResponse(worker=self.worker.name, holds_nothing=h.empty, open_calls=h.open_calls,
                                requests=h.requests, awaiting_kv=h.awaiting_kv, held_blocks=h.held_blocks,
                                stall_bound_s=self.worker.liveness.bound_s)

    def ChangeRole(self, request: pb.ChangeRoleRequest, context: grpc.ServicerContext) -> pb.ChangeRoleResponse:
        """Become a worker of `request.role` in this process, weights kept (worker/role_change.py)."""
        if self.role_changes is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          f"{self.worker.name} runs as `python -m <role>`, which serves one role; "
                          "a process started by `python -m deploy.role_process` can change it")
        why = self.role_changes.ask(RoleChange(request.role, request.worker_id, request.incarnation,
                                               tuple(request.args)))
        if why:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return pb.ChangeRoleResponse(worker=self.worker.name)
