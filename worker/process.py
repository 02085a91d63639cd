"""What the prefill and decode worker processes share: flags, engine and agent set-up, the
gRPC server, a clean shutdown on SIGTERM / Ctrl-C, and the change of role in place
(`main` with both roles: worker/role_change.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from common.model_source import resolve_model
from common.parent_watch import watch_parent
from common.tokenizer import Tokenizer
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.private_folder import UnsafeFolder
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc import proof, transport
from rpc.auth import SERVER_OPTIONS, ServerAuth, internal_token, require_token_off_loopback
from transfer import KVLayout, TransferAgent, agent_name
from worker import kv_disk_folders, rank_metrics
from worker.exit_codes import RANK_LOST
from worker.liveness import DEFAULT_STALL_FLOOR_S
from worker.loop import EngineLoop
from worker.role_change import RoleChange, RoleChanges
from worker.service import WorkerService

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 256
_SIGNAL_POLL_S = 0.5
CONTROL_RPC_THREADS = 16  # Health, Stats, Abort, SetPeers, TransferInfo, Prove: short calls


def worker_arguments(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {role}", description=f"pdserve {role} worker (gRPC)")
    p.add_argument("--model", default="smollm2", help="'smollm2', a Hugging Face folder or a .gguf file")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: bfloat16 where this CPU computes it natively, else float32), bfloat16, float32")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (cluster-internal)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-id", default="0")
    p.add_argument("--incarnation", type=int, default=None, help="default: start time in ms (unique per restart)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV pool size in blocks (default: --kv-memory-gib)")
    p.add_argument("--kv-memory-gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-disk-dir", default=None,
                   help="the prefix cache's disk tier: blocks the KV pool evicts are kept in files under "
                        "DIR/<role>-<worker-id>/ and read back on a hit (default: off)")
    p.add_argument("--kv-disk-gib", type=float, default=4.0, help="the disk tier's bound (with --kv-disk-dir)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="queue bound; past it requests are refused at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads for this process (each rank's with "
                                                                "--tensor-parallel-size)")
    p.add_argument("--device", default="cpu", help="where the weights, the KV pool and the steps live: cpu, or "
                                                   "cuda / cuda:N")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is sharded over, one process each (engine/parallel/); KV moves "
                        "to and from workers of any degree the model's KV heads allow (transfer/ranks.py)")
    p.add_argument("--no-transfer", action="store_true", help="no NIXL agent (aggregated mode only)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_FLOOR_S,
                   help="floor of the stall bound: a worker with work that completes no step for "
                        "max(this, 10x its longest measured step) seconds is wedged (worker/liveness.py)")
    p.set_defaults(role=role)  # names this worker's disk-tier folder
    return p


def build_engine(args: argparse.Namespace) -> tuple[LLMEngine, str]:
    require_token_off_loopback(args.host)  # before the slow part: a refused bind fails at once
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model_cfg = ModelConfig.from_pretrained(path)
    # a latent model's ranks on CPU share one pool when it transfers (engine/parallel/rank_group.py)
    one_pool = model_cfg.mla is not None and not args.no_transfer and args.device == "cpu"
    if args.kv_disk_dir is not None and args.tensor_parallel_size > 1 and not one_pool:
        raise SystemExit(f"--kv-disk-dir with --tensor-parallel-size {args.tensor_parallel_size}: the disk tier "
                         "is not supported with tensor parallelism (each rank's pool holds its own KV heads; a "
                         "latent model's ranks sharing one pool on CPU excepted); drop one of the two")
    eos = Tokenizer.from_pretrained(path).eos_token_ids if (path / "tokenizer.json").is_file() else frozenset()
    cache, scheduler = engine_configs(args, model_cfg.max_model_len)
    claim_disk_tier(args, cache)
    engine = LLMEngine.from_folder(path, args.dtype, cache, scheduler, eos, args.tensor_parallel_size,
                                   share_rank_pools=not args.no_transfer,  # its agent registers every rank's pool
                                   device=args.device)
    if engine.ranks is not None:
        engine.ranks.on_lost = _end_with_lost_rank
        if engine.ranks.lost:  # lost while the engine was still loading
            _end_with_lost_rank(engine.ranks.lost)
        rank_metrics.register(engine.ranks.clocks)
        log.info("tensor-parallel group of %d ranks, %d threads each: ranks 1.. are pids %s",
                 args.tensor_parallel_size, args.threads, " ".join(map(str, engine.ranks.pids)))
    return engine, path.name


def _end_with_lost_rank(what: str) -> None:
    """A rank of this worker's tensor-parallel group died: no step can run again, so the
    worker ends at once, as a crashed worker would (its peers move or fail its requests
    and the deployment replaces the whole group); its other ranks see rank 0 gone and end."""
    log.critical("tensor-parallel %s: the group cannot step; ending this worker (exit code %d) so that it is "
                 "replaced as a whole", what, RANK_LOST)
    logging.shutdown()
    os._exit(RANK_LOST)


def engine_configs(args: argparse.Namespace, model_len: int) -> tuple[CacheConfig, SchedulerConfig]:
    """The KV pool and scheduler a worker's flags ask for. The disk tier's folder is the
    worker's own, by role and worker id: two workers on one node never share files, and a
    restarted worker (same role and id) finds its blocks again."""
    if args.kv_disk_gib <= 0:
        raise SystemExit(f"--kv-disk-gib {args.kv_disk_gib}: must be more than 0")
    disk_dir = None if args.kv_disk_dir is None else os.path.join(args.kv_disk_dir, f"{args.role}-{args.worker_id}")
    return (CacheConfig(args.block_size, args.kv_blocks, args.kv_memory_gib, disk_dir=disk_dir,
                        disk_bytes=int(args.kv_disk_gib * 2**30)),
            SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, model_len, args.max_waiting))


def claim_disk_tier(args: argparse.Namespace, cache: CacheConfig) -> None:
    """The worker's disk tier folder made its own for its life, and the folders of workers
    gone from this node reclaimed (worker/kv_disk_folders.py); a folder it may not use ends
    the process naming why."""
    if cache.disk_dir is None:
        return
    try:
        kv_disk_folders.claim(Path(cache.disk_dir))
    except (kv_disk_folders.InUse, UnsafeFolder) as e:
        raise SystemExit(f"--kv-disk-dir: {e}") from None
    kv_disk_folders.reclaim(Path(args.kv_disk_dir), cache.disk_bytes, time.time())


def build_agent(role: str, args: argparse.Namespace, engine: LLMEngine, model: str) -> TransferAgent | None:
    if args.no_transfer:
        return None
    incarnation = args.incarnation if args.incarnation is not None else int(time.time() * 1000)
    pool = engine.kv_pool
    try:
        ranks = engine.rank_pools()  # a tensor-parallel worker's agent registers every rank's pool
    except RuntimeError as e:
        raise SystemExit(f"--tensor-parallel-size {args.tensor_parallel_size}: {e}; serve aggregated "
                         "(--no-transfer)") from None
    holds = "latent" if engine.config.model.mla is not None else "kv_heads"  # said in the handshake
    return TransferAgent(agent_name(role, args.worker_id, incarnation), pool, KVLayout.of_pool(pool, holds=holds),
                         model, ranks)


def rpc_threads(scheduler: SchedulerConfig) -> int:
    """gRPC threads for a worker: one per request it may hold (a stream, or a unary call
    that waits for its answer, holds a thread while it runs: `max_num_seqs` running plus
    `max_waiting` queued), plus room for the control calls (Health, Stats, Abort, SetPeers)
    so they never wait behind requests for a thread."""
    waiting = scheduler.max_waiting if scheduler.max_waiting is not None else DEFAULT_MAX_WAITING
    return scheduler.max_num_seqs + waiting + CONTROL_RPC_THREADS


@dataclass(frozen=True)
class Serving:
    """One role served by a process: its engine loop and what it adds to the gRPC server."""

    worker: EngineLoop
    add_servicers: Callable[[grpc.Server], None]


@dataclass(frozen=True)
class Role:
    """How a process serves one role: its flags, and its worker over a built engine (with
    the model folder's name: the agent's handshake names it)."""

    name: str
    arguments: Callable[[], argparse.ArgumentParser]
    build: Callable[[argparse.Namespace, LLMEngine, str], Serving]


def main(roles: dict[str, Role], role: str, argv: list[str] | None = None) -> None:
    """A worker process: load the model once and serve `role` until SIGTERM. With more than
    one role in `roles`, a ChangeRole the worker accepts (drained, holding nothing:
    worker/role_change.py) ends this role and the same process serves the next one over the
    same weights, on a new port (deploy/role_process.py)."""
    args = roles[role].arguments().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, model = build_engine(args)
    while True:
        serving = roles[role].build(args, engine, model)
        change = serve(serving.worker, serving.add_servicers, args.host, args.port, role_changes=len(roles) > 1)
        if change is None or _stop.terminating:
            engine.close()  # the disk tier writes what it has queued; the other ranks stop
            return
        log.info("%s: becoming %s worker %s over the same weights", serving.worker.name, change.role,
                 change.worker_id)
        kept = ["--model", args.model, "--dtype", args.dtype, "--host", args.host, "--port", "0"]
        args = roles[change.role].arguments().parse_args(
            [*kept, "--worker-id", change.worker_id, "--incarnation", str(change.incarnation), *change.args])
        torch.set_num_threads(args.threads)
        old, role = serving.worker.engine, change.role
        del serving  # the old role's loop, agent and servicers: its KV pool goes with them
        gc.collect()
        configs = engine_configs(args, old.config.model.max_model_len)
        claim_disk_tier(args, configs[0])
        engine = old.over_weights_of(*configs)


class _Stop:
    """A process's end (SIGTERM, Ctrl-C, its host gone) or a role's end (an accepted role
    change): either wakes the serve loop."""

    def __init__(self):
        self.wake = threading.Event()
        self.terminating = False
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.terminate())
        watch_parent(self.terminate)  # hosted by a Ray actor: end with it

    def terminate(self) -> None:
        self.terminating = True
        self.wake.set()


_stop = _Stop()


def serve(worker, add_servicer: Callable[[grpc.Server], None], host: str, port: int,
          role_changes: bool = False) -> RoleChange | None:
    """Run the worker's loop and gRPC server until SIGTERM or Ctrl-C (returns None), or, with
    `role_changes`, until a ChangeRole is accepted (returns it); then stop both."""
    token = internal_token()
    threads = rpc_threads(worker.engine.config.scheduler)
    log.info("%s: %d gRPC threads", worker.name, threads)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                         interceptors=[ServerAuth(token)] if token else None, options=SERVER_OPTIONS)
    add_servicer(server)
    changes = RoleChanges(worker, _stop.wake) if role_changes else None
    pb_grpc.add_WorkerServicer_to_server(WorkerService(worker, changes), server)  # TransferInfo, Health, Stats...
    bound = transport.add_port(server, f"{host}:{port}")  # mutual TLS when the deployment has its CA
    if bound == 0:
        raise SystemExit(f"cannot bind {host}:{port}")
    server.add_generic_rpc_handlers((proof.handler(token, f"{host}:{bound}"),))  # clients check it first
    worker.address = f"{host}:{bound}"
    worker.warm_up()  # before it is ready: the longest step to expect, measured, not assumed
    worker.start()
    server.start()
    _stop.install()
    print(f"{worker.name} ready on {host}:{bound}", file=sys.stderr, flush=True)
    # Woken every half second: a signal the kernel hands to another of the process's threads
    # (gRPC's, NIXL's) runs its Python handler only once this thread runs bytecode again, and
    # a wait with no timeout never returns to run it (a SIGTERM then went unanswered).
    while not _stop.wake.wait(_SIGNAL_POLL_S):
        pass
    change = None if _stop.terminating or changes is None else changes.accepted
    if change is None:
        log.info("%s: shutting down", worker.name)
    else:
        _stop.wake.clear()
        log.info("%s: stopping to become %s worker %s", worker.name, change.role, change.worker_id)
    worker.shutdown()  # the loop and its pushes first, then the server
    server.stop(grace=worker.loop_wait_s()).wait()  # ends as soon as the last calls have their answers
    log.info("%s: stopped", worker.name)
    if worker.agent is not None:
        worker.agent.close()
    return change
