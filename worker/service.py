"""What every worker's gRPC service answers the same way: TransferInfo, Health, Stats."""

from __future__ import annotations

import grpc

from rpc import pdserve_pb2 as pb

# An idle worker's probe is one token through the loop, which picks it up within a
# millisecond; past this wait (or the call's deadline) the loop's own heartbeat decides.
DEEP_HEALTH_PROBE_WAIT_S = 5.0


class WorkerServiceMixin:
    """Mixed into a servicer whose `worker` is an EngineLoop with `name`, `agent` and
    `kv_blocks_transferred`."""

    worker: object

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
        v = self.worker.health(wait)
        return pb.HealthResponse(ok=v.ok, detail=v.detail, worker=self.worker.name, busy=v.busy,
                                 last_step_age_s=v.last_step_age_s, stall_bound_s=v.stall_bound_s,
                                 longest_step_s=v.longest_step_s, queued=v.queued)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        # Plain reads of counters the loop thread updates: each is consistent on its own.
        w, e = self.worker, self.worker.engine.stats()
        return pb.StatsResponse(
            worker=w.name, waiting_requests=e.num_waiting, waiting_tokens=e.waiting_tokens,
            running_requests=e.num_running, free_blocks=e.free_blocks,
            total_blocks=e.total_blocks, prefix_cache_hit_rate=e.prefix_cache_hit_rate,
            step_seconds=w.last_step_seconds, preemptions=e.num_preemptions,
            kv_blocks_transferred=w.kv_blocks_transferred, block_size=e.block_size,
            prefill_tokens_per_s=w.liveness.prefill_tokens_per_s, deep_probes=w.num_probes,
        )
