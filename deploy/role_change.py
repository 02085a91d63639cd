"""A planner move without a cold start: the moved worker changes role in its own process.

A move (one pool grows as the other shrinks) used to start a new worker (its process, its
weights loaded, its warm-up: minutes for a large model on a GPU) and drain the old one.
When both pools reserve the same bundle, the controller instead drains a worker of the
shrinking pool (a decode worker hands its streams and their KV to the others: a few
steps) and asks it to become a worker of the growing pool: it keeps its process, its
placement and its loaded weights, and builds the new role's KV pool, scheduler and NIXL
agent (worker/role_change.py). To its peers it is a new worker: a new id in its new pool,
a new incarnation, a new address.

What this file decides and does is apart from the controller's bookkeeping
(deploy/scaling.py `_change_role`), which updates the pools and the membership.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import ray

from deploy.config import DeployConfig
from deploy.slot import HostReport
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc


class RoleChangeFailed(Exception):
    """The worker did not become the new role (refused, or its process ended or never got
    ready): the controller replaces it with a cold start."""


@dataclass(frozen=True)
class Moves:
    """Workers a scale moves by changing role: `count` from `source` to `target`."""

    source: str
    target: str
    count: int


def in_place_moves(sizes: dict[str, int], targets: dict[str, int | None], config: DeployConfig) -> Moves | None:
    """The part of a scale that is a move (one pool grows, the other shrinks), done in place
    when `move_in_place` is on and both pools reserve the same bundles, of one rank (the
    worker's placement group stays where it is); None when nothing moves in place."""
    if not config.move_in_place or config.prefill.bundles() != config.decode.bundles() \
            or config.decode.tp_size > 1:  # a tensor-parallel worker's ranks keep their role: moves start cold
        return None
    grow = {role: (t or 0) - sizes[role] for role, t in targets.items() if t is not None}
    for source, target in (("prefill", "decode"), ("decode", "prefill")):
        count = min(-grow.get(source, 0), grow.get(target, 0))
        if count > 0:
            return Moves(source, target, count)
    return None


def change_role(stub: pb_grpc.WorkerStub, host: ray.actor.ActorHandle, role: str, worker_id: str, args: list[str],
                *, call_timeout_s: float, ready_timeout_s: float) -> HostReport:
    """Ask a drained worker to become `role` worker `worker_id` (with the role's flags
    `args`) and wait until it serves: returns its host's report (new address and
    incarnation). Raises RoleChangeFailed with the reason."""
    incarnation = int(time.time() * 1000)
    try:
        stub.ChangeRole(pb.ChangeRoleRequest(role=role, worker_id=worker_id, incarnation=incarnation, args=args),
                        timeout=call_timeout_s)
    except grpc.RpcError as e:
        raise RoleChangeFailed(f"ChangeRole refused: {e.code().name}: {e.details()}") from None
    try:
        return ray.get(host.became.remote(role, worker_id, incarnation, ready_timeout_s), timeout=ready_timeout_s + 30)
    except Exception as e:  # its process ended, or it was not ready in time: the message carries its log's tail
        raise RoleChangeFailed(str(e)) from None
