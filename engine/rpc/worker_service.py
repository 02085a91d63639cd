"""What every worker's gRPC service answers the same way: TransferInfo, Health, Stats."""

from __future__ import annotations

import logging

import grpc

from engine.rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)

DEEP_HEALTH_TIMEOUT_S = 5.0


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
        timeout = min(DEEP_HEALTH_TIMEOUT_S, remaining if remaining is not None else DEEP_HEALTH_TIMEOUT_S)
        try:
            self.worker.call(self.worker.engine.probe, timeout=max(0.05, timeout - 0.05))
        except TimeoutError:
            log.warning("deep health: the engine loop ran no forward pass within %.2fs", timeout)
            return pb.HealthResponse(ok=False, worker=self.worker.name,
                                     detail=f"engine loop ran no forward pass within {timeout:.2f}s")
        except Exception as e:
            return pb.HealthResponse(ok=False, worker=self.worker.name, detail=f"probe failed: {e}")
        return pb.HealthResponse(ok=True, worker=self.worker.name)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        # Plain reads of counters the loop thread updates: each is consistent on its own.
        w, e = self.worker, self.worker.engine
        return pb.StatsResponse(
            worker=w.name, waiting_requests=e.scheduler.num_waiting, waiting_tokens=e.scheduler.waiting_tokens,
            running_requests=e.scheduler.num_running, free_blocks=e.kv_manager.num_free_blocks,
            total_blocks=e.kv_manager.num_total_blocks, prefix_cache_hit_rate=e.kv_manager.prefix_cache_hit_rate,
            step_seconds=e.last_step.seconds if e.last_step else 0.0, preemptions=e.scheduler.num_preemptions,
            kv_blocks_transferred=w.kv_blocks_transferred, block_size=e.kv_manager.block_size,
        )
