"""A tensor-parallel rank other than 0: its shard of the model and its KV heads' pool, and
a loop that runs each step rank 0 plans (engine/parallel/step_plan.py) until told to stop.

It never schedules nor samples: it runs the forward pass and the LM head (whose logits are
all-gathered, so every rank takes part) and drops the logits. Plans come over a pipe, not a
collective, so an idle engine does not run into the collective's timeout, and a follower
whose rank 0 died sees the pipe close and exits.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

import kernels.memory
from engine.config import EngineConfig
from engine.kv_cache import KVCache, pool_shape
from engine.model_runner import ModelRunner
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.rank_clock import RankClocks, injected_stretch
from engine.parallel.sharded_weights import load_sharded_model
from engine.parallel.step_plan import StepPlan
from engine.step_buffers import StepLimits

GROUP_TIMEOUT_S = 600


def rank_device(device: str, rank: int) -> str:
    """The device a rank computes on: CPU ranks share the host; CUDA ranks take one device
    each from rank 0's on (`cuda` or `cuda:0` -> `cuda:r`, `cuda:2` -> `cuda:2+r`)."""
    d = torch.device(device)
    return f"cuda:{(d.index or 0) + rank}" if d.type == "cuda" else device


def join_group(rendezvous: str, size: int, rank: int, device: str = "cpu") -> None:
    """This process's place in the default process group: NCCL between CUDA ranks (one
    device each, this rank's made current first), gloo over loopback between CPU ranks.
    The NCCL path is written beside the gloo one and checked only where a GPU machine is
    at hand (docs/engine.md)."""
    if torch.device(device).type == "cuda":
        ours = torch.device(rank_device(device, rank))
        torch.cuda.set_device(ours)
        backend, options = "nccl", {"device_id": ours}
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one engine share a host
        backend, options = "gloo", {}
    # Bounds the group's forming and any one collective: a rank gone mid-step fails the
    # others' step within it instead of hanging them (gloo's own default is 30 minutes).
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S), **options)


def follower_main(config: EngineConfig, rank: int, rendezvous: str, num_blocks: int, limits: StepLimits,
                  num_threads: int, plans: Connection, clocks: RankClocks, pool_path: str | None = None) -> None:
    """`pool_path`: the file rank 0 made for this rank's KV pool (shared with it; a latent
    model's: the group's one pool), or None for a pool of its own."""
    # Ctrl-C, or a signal to the whole process group, is rank 0's to answer: it stops this
    # rank itself (a rank dying on it would read as a lost rank in the middle of a drain)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    size = config.tensor_parallel_size
    device = rank_device(config.device, rank)
    plans.send("started")  # imported and running: rank 0 joins the group only once every rank says so
    join_group(rendezvous, size, rank, config.device)
    try:
        layout = TensorParallelLayout.of(config.model, size, rank)
        model = load_sharded_model(config.model_path, config.model, layout, config.dtype, device,
                                   mtp=config.load_mtp)
        shape = pool_shape(model.local_cfg, num_blocks, config.cache.block_size)
        pool = kernels.memory.shared_zeros(pool_path, shape, config.dtype) if pool_path else None
        kv = KVCache(model.local_cfg, num_blocks, config.cache.block_size, config.dtype, device, pool)
        runner = ModelRunner(model, kv, device, limits)
        stretch = injected_stretch(rank)
        plans.send("ready")
        while True:
            try:
                plan = plans.recv()
            except EOFError:  # rank 0 is gone
                return
            if plan is None:
                return
            run_plan(runner, plan, clocks, rank, stretch)
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def run_plan(runner: ModelRunner, plan: StepPlan, clocks: RankClocks, rank: int, stretch: float = 1.0) -> None:
    """One step's collectives on this rank: the forward pass, and the LM head when a row is
    sampled (its logits dropped), timed into this rank's row of `clocks`."""
    step = runner.prepare(plan)
    clocks.timed(rank, runner.model.collectives, lambda: runner.forward(step), stretch)
