"""`pdserve serve` on a real Ray: embedded, and as a `ray job submit` job across two Ray
nodes pinned by custom resources; healing a killed worker actor and scaling under load.

Each test starts its own Ray (never `ray stop`, which would kill every Ray process on the
machine) and checks that nothing it started outlives it.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from bench.chaos.status_feed import StatusFeed
from bench.harness.gateway_procs import serving_process
from bench.harness.deploy_procs import (BIN, CHAT, ENV, answers, deployment_status, pdserve, ray_head, ray_node, serving,
                                        wait_for)
from bench.harness.worker_procs import REPO, free_port


@pytest.fixture(scope="module")
def embedded(smollm2_dir, tmp_path_factory):
    """The default system (1 prefill, 1 decode) on an embedded Ray with room for a third worker,
    its gateway two processes on the port (`--gateways 2`: every test here goes through them).
    Its workers wedge while the file `stall` next to the log names them (common/envs.py)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(log, "--dtype", "float32", "--port", str(port), "--num-cpus", "4", "--gateways", "2",
                 env={"PDSERVE_FAULT_STALL_FILE": str(log.with_name("stall"))}) as (proc, address):
        yield f"http://127.0.0.1:{port}", address, log


@pytest.fixture(scope="module")
def status(embedded):
    """The embedded deployment's status, what `pdserve status --json` prints, from one Ray
    driver kept open (bench/chaos/status_feed.py): the command joins the cluster anew each
    time, seconds of CPU taken from the workers these tests start and move. The first test
    reads it through the command itself."""
    feed = StatusFeed(embedded[1], ENV, embedded[2].with_name("status-feed.log"))
    yield feed.status
    feed.close()


def test_serve_streams_a_completion(embedded):
    url, address, log = embedded
    text = log.read_text()
    for step in ("preparing model", "prefill worker 0: ready", "decode worker 0: ready", "gateway ready"):
        assert step in text, text
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=16, temperature=0, stream=True) if c.choices]
    assert "Paris" in "".join(parts)
    assert answers(url)
    rounds = _health_rounds(url)
    wait_for(lambda: _health_rounds(url) >= rounds + 3, 60, "three health rounds", log)  # every worker passes them
    status = deployment_status(address)
    workers = status["pools"]["prefill"] + status["pools"]["decode"]
    assert [(w["state"], w["restarts"]) for w in workers] == [("ready", 0), ("ready", 0)], workers


def _gateway_front(port: int) -> psutil.Process:
    """The gateway's front process of the deployment serving on `port` (`--processes 2`)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "gateway" in cmd and "--processes" in cmd and str(port) in cmd:
            return p
    raise AssertionError(f"no gateway front process for port {port}")


def test_the_gateway_is_two_processes_on_one_port_each_serving(embedded):
    """`pdserve serve --gateways 2`: one front process and two gateway processes under it,
    and requests on new connections reach both (the kernel spreads them), each answered."""
    url, _, log = embedded
    port = int(url.rsplit(":", 1)[1])
    front = _gateway_front(port)
    children = front.children()
    assert len(children) == 2 and all("gateway" in c.cmdline() for c in children), [c.cmdline() for c in children]
    served: dict[int, int] = {}
    for _ in range(64):  # each connection lands on either child (1 in 2^32 that one gets them all)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
            assert conn.recv(64).startswith(b"HTTP/1.1 200"), "a gateway process did not answer /health"
            pid = serving_process(front, conn)
        served[pid] = served.get(pid, 0) + 1
        if len(served) == 2:
            break
    assert set(served) == {c.pid for c in children}, (served, [c.pid for c in children])


def _selectors(expr: str) -> tuple[list[tuple[str, dict[str, str]]], set[str]]:
    """The series a PromQL expression selects (name, equality matchers) and the labels it groups by."""
    selected = [(m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
                for m in re.finditer(r"\b(pdserve_\w+)(\{[^}]*\})?", expr)]
    grouped = {label.strip() for clause in re.findall(r"by \(([^)]*)\)", expr) for label in clause.split(",")}
    return selected, grouped - {"le", ""}


def test_every_series_the_dashboard_queries_is_in_the_deployments_one_scrape(embedded):
    """deploy/grafana/pdserve.json's queries all find their series (with the labels they
    match and group by) in the gateway's /metrics, the controller's pool sizes, health
    verdicts and planner decisions among them."""
    import json

    from prometheus_client.parser import text_string_to_metric_families

    url, _, _ = embedded
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0)

    def scrape() -> list:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    samples = wait_for(lambda: (lambda got: got if any(
        s.name == "pdserve_health_verdicts_total" and s.labels.get("verdict") == "ok" and s.value > 0
        for s in got) else None)(scrape()), 60, "a health round's verdicts in the scrape")
    ready = {s.labels["pool"]: s.value for s in samples
             if s.name == "pdserve_pool_workers" and s.labels.get("state") == "ready"}
    assert ready == {"prefill": 1, "decode": 1}, ready
    assert all(s.labels.get("role") == "controller" and s.labels["worker"].startswith("controller-")
               for s in samples if s.name == "pdserve_pool_workers")
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    targets = [(p["title"], t) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    for title, target in targets:
        selected, grouped = _selectors(target["expr"])
        assert selected, (title, target["expr"])
        labels_seen: set[str] = set()
        for name, matchers in selected:
            matching = [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in matchers.items())]
            assert matching, f"{title}: no series {name}{matchers} in the scrape"
            labels_seen |= {k for s in matching for k in s.labels}
        assert grouped <= labels_seen, f"{title}: groups by {grouped - labels_seen}, which no series has"
        legend = set(re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")))
        assert legend <= labels_seen, f"{title}: legend names {legend - labels_seen}"


def _load(url: str, stop: threading.Event, results: list[int]) -> None:
    """Back-to-back requests until stop; every status code is recorded."""
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            body = {"model": "smollm2", "messages": CHAT, "max_tokens": 12, "temperature": 0}
            r = http.post(f"{url}/v1/chat/completions", json=body)
            results.append(r.status_code if r.status_code != 200 or r.json()["choices"][0]["message"]["content"]
                           else -1)


def _controller_metric(url: str, name: str, **labels: str) -> float:
    """A series of the controller's metrics (deploy/metrics.py) in the gateway's /metrics, as
    of its last push (one health round old at most): what the waits here poll, where a
    `pdserve status` per poll would join the Ray cluster anew (seconds of CPU each, taken
    from the workers starting meanwhile). What they wait for is then checked in the status."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _health_rounds(url: str) -> float:
    """The controller's ok verdicts on the prefill worker so far: one per health round (its
    metrics reach the gateway's /metrics with each round's membership push)."""
    return _controller_metric(url, "pdserve_health_verdicts_total", pool="prefill", verdict="ok")


def test_scaling_up_and_down_under_load_fails_no_request(embedded, status):
    """While a new worker loads (held before its warm-up here), health rounds go on: a scale
    holds the controller's lock only to change the pools, never through a worker's start."""
    url, address, log = embedded
    stop, results = threading.Event(), []
    stall = log.with_name("stall")
    stall.write_text("decode-1")  # the new decode worker does not get ready until this goes
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        loads = [pool.submit(_load, url, stop, results) for _ in range(2)]
        try:
            scaling = pool.submit(pdserve, "scale", "--address", address, "--decode", "2", "--prefill", "1",
                                  timeout=240)
            wait_for(lambda: _controller_metric(url, "pdserve_pool_workers", pool="decode", state="starting"), 120,
                     "the new decode worker placed", log)
            rounds = _health_rounds(url)
            wait_for(lambda: _health_rounds(url) >= rounds + 2, 60, "two health rounds during the scale", log)
            assert not scaling.done() and status()["starting"][0]["role"] == "decode"
            stall.unlink()
            up = scaling.result()
            assert up.returncode == 0, up.stderr
            decode = status()["pools"]["decode"]
            assert len(decode) == 2 and all(s["state"] == "ready" for s in decode)
            served_before = len(results)
            wait_for(lambda: len(results) > served_before + 4, 60, "requests served by the larger pool")
            down = pdserve("scale", "--address", address, "--decode", "1", timeout=240)
            assert down.returncode == 0, down.stderr
            served_after = len(results)
            wait_for(lambda: len(results) > served_after + 2, 60, "requests served after scaling down")
        finally:
            stop.set()
        for f in loads:
            f.result()
    assert results and set(results) == {200}, results
    assert [s["worker_id"] for s in status()["pools"]["decode"]] == ["0"]


def test_a_killed_worker_actor_is_replaced_and_serving_resumes(embedded, status):
    url, address, log = embedded
    before = status()["pools"]["decode"][0]
    adopted = _controller_metric(url, "pdserve_health_verdicts_total", pool="decode", verdict="adopted")
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 300, "stream": True, "logit_bias": {"2": -100}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        assert "error" not in next(lines)
        os.kill(before["host_pid"], signal.SIGKILL)  # the actor hosting the decode worker
        rest = list(lines)  # ends: an error event, then [DONE]; never a hang
    assert rest[-1] == "data: [DONE]" and "error" in rest[-2], rest[-3:]
    wait_for(lambda: not psutil.pid_exists(before["pid"]), 10, "the orphaned worker process exiting")
    wait_for(lambda: _controller_metric(url, "pdserve_health_verdicts_total", pool="decode", verdict="adopted")
             > adopted, 120, "a new decode incarnation adopted", log)

    def replaced():
        now = status()["pools"]["decode"][0]
        return now["state"] == "ready" and now["incarnation"] != before["incarnation"] and now
    after = wait_for(replaced, 120, "a new decode incarnation", log)
    assert after["restarts"] >= 1 and after["address"] != before["address"]
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def served():
        try:
            return client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0)
        except Exception:
            return None
    reply = wait_for(served, 30, "serving after the replacement")
    assert "Paris" in reply.choices[0].message.content


def test_a_move_between_the_pools_changes_a_workers_role_in_place(embedded, status):
    """1 prefill + 1 decode -> 0 + 2 -> 1 + 1 under load: each move drains a worker and changes
    its role in its own process (weights kept, no new worker placed). Between the two, the
    moved worker's host is killed: Ray restarts it as what it was placed as (a prefill
    worker) and the controller puts it back in the decode pool. No request fails."""
    url, address, log = embedded
    moved = status()["pools"]["prefill"][0]
    stop, results = threading.Event(), []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loads = [pool.submit(_load, url, stop, results) for _ in range(2)]
        try:
            to_decode = pdserve("scale", "--address", address, "--prefill", "0", "--decode", "2", timeout=240)
            assert to_decode.returncode == 0, to_decode.stderr
            now = status()["pools"]
            assert now["prefill"] == [] and len(now["decode"]) == 2, now
            became = now["decode"][-1]  # the same process and host; a new worker id and address
            assert (became["pid"], became["host_pid"]) == (moved["pid"], moved["host_pid"]), (moved, became)
            assert became["address"] != moved["address"] and became["state"] == "ready"
            served = len(results)
            wait_for(lambda: len(results) > served + 4, 60, "requests served by two decode workers")

            os.kill(became["host_pid"], signal.SIGKILL)  # Ray restarts the host: its process starts as prefill
            wait_for(lambda: _controller_metric(url, "pdserve_role_changes_total", from_pool="prefill",
                                                to_pool="decode", outcome="restored"), 180,
                     "the moved worker restored to the decode pool", log)

            def restored():
                now = status()["pools"]["decode"][-1]
                return now["state"] == "ready" and now["incarnation"] != became["incarnation"] and now
            after = wait_for(restored, 180, "the moved worker back in the decode pool", log)
            assert after["worker_id"] == became["worker_id"] and after["host_pid"] != became["host_pid"]
            served = len(results)
            wait_for(lambda: len(results) > served + 4, 60, "requests served after the restore")

            back = pdserve("scale", "--address", address, "--prefill", "1", "--decode", "1", timeout=240)
            assert back.returncode == 0, back.stderr
            now = status()["pools"]
            assert now["prefill"][0]["pid"] == after["pid"] and len(now["decode"]) == 1, now
            served = len(results)
            wait_for(lambda: len(results) > served + 2, 60, "requests served after the move back")
        finally:
            stop.set()
        for f in loads:
            f.result()
    assert results and set(results) == {200}, results
    text = log.read_text()
    assert text.count("role changed in place") == 2 and "moved in place (prefill -> decode)" in text, text[-3000:]
    assert "changing it back to decode" in text, text[-3000:]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for source, target, outcome in (("prefill", "decode", "done"), ("decode", "prefill", "done"),
                                    ("prefill", "decode", "restored")):
        wanted = (f'from_pool="{source}"', f'to_pool="{target}"', f'outcome="{outcome}"')
        series = [line for line in metrics.splitlines()
                  if line.startswith("pdserve_role_changes_total{") and all(w in line for w in wanted)]
        assert series and float(series[0].split()[-1]) == 1.0, (wanted, metrics)


def test_a_saturated_worker_whose_steps_outlast_the_health_deadline_is_kept(smollm2_dir, tmp_path, monkeypatch):
    """Every working step lasting at least 1.2 s (PDSERVE_FAULT_STEP_FLOOR_S: a slow host,
    the same on any real one) and the prefill worker saturated with long prompts, under a
    strict controller: deep health answers within a 1 s deadline, one miss in a row
    replaces. Steps then take longer than that deadline (a probe queued behind one would
    miss it, as it did before liveness was judged by progress), yet no worker is replaced
    and every request is served."""
    from rpc import auth
    from rpc import pdserve_pb2 as pb
    from rpc import pdserve_pb2_grpc as pb_grpc

    token = "saturation-test-token"
    config = tmp_path / "strict.yaml"
    config.write_text("prefill: {replicas: 1, kv_blocks: 512}\ndecode: {replicas: 1, kv_blocks: 512}\n"
                      "gateway: {max_ttft_s: null}\n"
                      f"health_interval_s: 0.5\nhealth_timeout_s: 1.0\nunhealthy_after: 1\ninternal_token: {token}\n")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    prompt = "Tell me about the sea and its ships. " * 60  # ~540 tokens: two prefill steps each
    with serving(log, "--config", str(config), "--port", str(port), "--num-cpus", "4",
                 env={"PDSERVE_FAULT_STEP_FLOOR_S": "1.2"}) as (_, address):
        (prefill,) = deployment_status(address)["pools"]["prefill"]
        monkeypatch.setenv(auth.ENV, token)
        stub = pb_grpc.WorkerStub(auth.channel(prefill["address"]))
        verdicts: list = []
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three prompts queue: six stretched steps
            def one(i: int) -> int:
                body = {"model": "smollm2", "prompt": f"{i} {prompt}", "max_tokens": 2, "ignore_eos": True}
                return httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code
            sent = [pool.submit(one, i) for i in range(3)]
            while not all(f.done() for f in sent):
                verdicts.append(stub.Health(pb.HealthRequest(deep=True), timeout=5))
                time.sleep(0.5)
            codes = [f.result() for f in sent]
        busy = [v for v in verdicts if v.busy]
        assert busy and all(v.ok for v in verdicts), [v for v in verdicts if not v.ok][:3]
        assert max(v.longest_step_s for v in busy) > 1.0, busy[-1]  # steps outlasted the deadline
        assert codes == [200] * 3, codes
        pools = deployment_status(address)["pools"]
        workers = pools["prefill"] + pools["decode"]
        assert [w["restarts"] for w in workers] == [0, 0], workers
        assert "replacing it" not in log.read_text(), log.read_text()[-3000:]


def test_a_ray_job_places_the_pools_on_the_nodes_with_their_resources_and_kv_crosses(smollm2_dir, tmp_path):
    """`ray job submit` of `pdserve serve` on a cluster of two Ray nodes on this machine, one
    labelled `prefill` (the head), one `decode`: each pool lands on its node, a prompt's KV
    crosses between them, and stopping the job stops the system. No `--working-dir`: two
    nodes on one machine share Ray's temp dir, and the second node's runtime-env agent once
    removed the job's unpacked copy while the job imported from it (the package is installed
    here; on a real cluster `--working-dir .` ships it, docs/deploy.md)."""
    from ray.util.state import list_nodes

    config = tmp_path / "two-nodes.yaml"
    config.write_text("dtype: float32\n"
                      "prefill: {replicas: 1, resources: {prefill: 1}, kv_blocks: 256}\n"
                      "decode: {replicas: 1, resources: {decode: 1}, kv_blocks: 256}\n")
    port = free_port()
    with ray_head(tmp_path, "--num-cpus=2", '--resources={"prefill": 1}') as (gcs, dashboard), \
            ray_node(tmp_path, gcs, "--num-cpus=1", '--resources={"decode": 1}'):
        def submit():
            done = subprocess.run(
                [str(BIN / "ray"), "job", "submit", f"--address={dashboard}", "--no-wait",
                 "--", "python", "-m", "deploy", "serve", "--config", str(config), "--port", str(port)],
                cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
            # the dashboard answers before the node's job agent has registered: Ray says to retry
            assert done.returncode == 0 or "try again later" in done.stderr, done.stdout + done.stderr
            return done if done.returncode == 0 else None
        submit = wait_for(submit, 60, "a job submission accepted")
        job = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)

        def logs() -> str:
            return subprocess.run([str(BIN / "ray"), "job", "logs", f"--address={dashboard}", job], env=ENV,
                                  capture_output=True, text=True, timeout=60).stdout
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not answers(url):
            assert time.monotonic() < deadline, logs()[-3000:]
            time.sleep(1)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        nodes = {n.node_id: n.resources_total for n in list_nodes(address=dashboard, detail=True)}
        status = deployment_status(gcs)
        (prefill,), (decode,) = status["pools"]["prefill"], status["pools"]["decode"]
        assert "prefill" in nodes[prefill["node_id"]] and "decode" in nodes[decode["node_id"]], (nodes, status)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("pdserve_worker_kv_blocks_transferred") and "decode" in line]
        assert moved and moved[0] > 0, metrics  # the prompt's KV crossed from one node to the other
        stop = subprocess.run([str(BIN / "ray"), "job", "stop", f"--address={dashboard}", job], env=ENV,
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        wait_for(lambda: not answers(url), 60, "the gateway gone after the job stopped")
