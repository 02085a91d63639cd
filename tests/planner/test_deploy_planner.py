"""The online planner on a real deployment (`pdserve serve`, embedded Ray, SmolLM2): it
moves workers between the pools as the workload changes, and no request fails. Its own
module: one of the longest tests of the suite, so it runs beside the others under `make test`.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from contextlib import closing

import httpx

from bench.chaos.status_feed import StatusFeed
from bench.harness.deploy_procs import ENV, serving, wait_for
from bench.harness.worker_procs import free_port


def _closed_loop(url: str, stop: threading.Event, body: dict, results: list[int]) -> None:
    with httpx.Client(timeout=120) as http:
        i = 0
        while not stop.is_set():
            i += 1
            prompt = body["prompt"] if isinstance(body["prompt"], str) else None
            payload = {**body, "prompt": f"{threading.get_ident()} {i} {prompt}"} if prompt else body
            results.append(http.post(f"{url}/v1/completions", json=payload).status_code)


def _pool_sizes(feed: StatusFeed) -> tuple[int, int]:
    pools = feed.status()["pools"]
    return len(pools["prefill"]), len(pools["decode"])


def _ready_in_metrics(url: str) -> tuple[int, int]:
    """The pools' ready workers as the controller last pushed them to the gateway's /metrics:
    what the wait for a move polls (`pdserve status` joins the Ray cluster anew, seconds of
    CPU a call, which a poll every half second would take from the workers being measured)."""
    from prometheus_client.parser import text_string_to_metric_families

    ready = {"prefill": 0, "decode": 0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "pdserve_pool_workers" and s.labels.get("state") == "ready" and s.labels.get("pool") in ready:
                ready[s.labels["pool"]] += int(s.value)
    return ready["prefill"], ready["decode"]


def test_the_online_planner_follows_the_workload_between_the_pools(smollm2_dir, tmp_path):
    """1 prefill + 2 decode workers under prompt-heavy load: the planner moves a worker to
    prefill; then under output-heavy load it moves one back to decode. No request fails."""
    from deploy.planner.profile import measure

    # decode batches up to the 24 clients of the second phase: a fit over batches 1 and 4 alone
    # can come out flat in batch on a noisy host (then no split looks better for decoding);
    # contexts around the second phase's (~20 prompt + 64 output tokens): each point's batch is
    # prefilled first, so longer ones would cost the measurement most of its time
    grid = {"prefill": [32, 256], "long_prompt": 1024, "decode_batch": [1, 8, 24], "decode_context": [32, 128]}
    measure(str(smollm2_dir), "auto", 1, grid, say=lambda m: None).save(tmp_path / "profile.json")
    (tmp_path / "planner.yaml").write_text(
        # 512 KV blocks each: the moves are about scheduling, not memory (the suite runs beside it)
        "prefill: {replicas: 1, kv_blocks: 512}\ndecode: {replicas: 2, kv_blocks: 512}\n"
        # never shed: a slow host's predicted TTFT would turn load into 429s, and this test is
        # about workers moving under load with no request lost (shedding is the overload test's)
        "gateway: {max_ttft_s: null}\n"
        f"planner: {{enabled: true, profile: {tmp_path / 'profile.json'}, slo_ttft_s: 2.0, slo_tpot_s: 0.5,\n"
        "          interval_s: 4, cooldown_s: 4, min_requests: 4}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    story = "Tell me a long story about the sea and its ships. " * 60  # ~700 tokens
    # The second phase's outputs are 3x its prompts: output-heavy, and each window's requests
    # finish within a few dozen decode steps.
    phases = [({"model": "smollm2", "prompt": story, "max_tokens": 2, "ignore_eos": True}, 2, (2, 1)),
              ({"model": "smollm2", "prompt": "Count:", "max_tokens": 64, "ignore_eos": True}, 24, (1, 2))]
    with serving(log, "--config", str(tmp_path / "planner.yaml"), "--port", str(port), "--num-cpus", "5") \
            as (_, address), closing(StatusFeed(address, ENV, tmp_path / "status-feed.log")) as feed:
        assert _pool_sizes(feed) == (1, 2)  # its status, through one Ray driver kept open (not one per read)
        results: list[int] = []
        for body, clients, target in phases:
            stop = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                loads = [pool.submit(_closed_loop, url, stop, body, results) for _ in range(clients)]
                try:
                    wait_for(lambda: _ready_in_metrics(url) == target, 180, f"the planner moving to {target}", log)
                finally:
                    stop.set()
                assert _pool_sizes(feed) == target  # the deployment's own status agrees
                for f in loads:
                    f.result()
        assert "planner: " in log.read_text() and results and set(results) == {200}, set(results)
        # Its moves are on the one scrape: decisions counted, the target and the pools' sizes.
        def scaled() -> str | None:
            text = httpx.get(f"{url}/metrics", timeout=30).text
            moves = [float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("pdserve_planner_decisions_total{") and 'decision="scale"' in line]
            return text if moves and moves[0] >= 2 and re.search(
                r'pdserve_pool_target_workers\{[^}]*pool="decode"[^}]*\} 2\.0', text) else None
        wait_for(scaled, 30, "two scale decisions and the decode target of 2 in /metrics", log)
