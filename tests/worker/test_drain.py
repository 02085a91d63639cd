"""Workers that leave lose no request (deploy/drain.py, worker/holdings.py, the gateway's
retry before the first token): real prefill and decode processes behind real gateways.

The prefill worker's steps are held to at least STEP_FLOOR_S each, so a request's KV is
still being prefilled remotely for seconds: the state the old drain (Stats: 0 running, 0
waiting, idle for a second) took for an idle worker, and stopped it with the request in it.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading

import httpx
import pytest

from bench.harness.gateway_procs import admin_gateway, data_lines, gateway, metric_value
from bench.harness.worker_procs import WorkerProc, start_workers, wait_idle, wait_until
from deploy.drain import DrainEnd, drain, holdings_of
from rpc import pdserve_pb2 as pb

STEP_FLOOR_S = 2.0  # each prefill step: a ~600-token prompt is two steps, so >= 4 s of remote prefill
STORY = "Tell me a long story about the sea and its ships. " * 50  # ~600 tokens
ARGS = ["--dtype", "float32", "--kv-blocks", "256"]
MAX_TOKENS = 8
EXIT_GUARD_S = 120  # a guard against a hang, not a speed bound
ADMIN_TOKEN = "admin-token-for-the-drain-test"


@pytest.fixture(scope="module")
def workers(smollm2_dir, tmp_path_factory):
    """A slow prefill worker and two decode workers; yields (prefill, decode A, decode B)."""
    logs = tmp_path_factory.mktemp("drain")
    specs = [("prefill", ARGS, {"PDSERVE_FAULT_STEP_FLOOR_S": str(STEP_FLOOR_S)}),
             ("decode", ARGS, {}), ("decode", ARGS, {})]
    procs = start_workers(specs, smollm2_dir, logs, timeout_s=120)
    yield procs
    for w in procs:
        w.stop()


def _complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})


def _decoded(worker: WorkerProc) -> float:
    """Tokens the worker's engine has computed in decode steps (and mixed ones) so far."""
    text = worker.stub.Metrics(pb.MetricsRequest(), timeout=30).exposition.decode()
    return sum(metric_value(text, "pdserve_engine_step_tokens_sum", kind=k) for k in ("decode", "mixed"))


def _admitted_remote(worker: WorkerProc, n: int) -> bool:
    return worker.log_path.read_text(errors="replace").count("remote prefill") >= n


def _sigterm_exits_cleanly(worker: WorkerProc) -> None:
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(EXIT_GUARD_S) == 0, worker.log_tail()


def _assert_idle(*workers: WorkerProc) -> None:
    for w in workers:
        s = wait_idle(w)
        assert s.free_blocks == s.total_blocks and s.running_requests == s.waiting_requests == 0, s


def test_a_drained_decode_worker_stops_only_once_it_holds_nothing(workers, smollm2_dir, tmp_path):
    """A request's KV is being prefilled remotely for A when A is drained: Stats shows A idle
    (0 running, 0 waiting), Drain does not (awaiting KV), and the drain ends only after the
    request has its answer. A request routed to A after the drain began (a gateway that
    has not heard of it) is refused there and retried on B. Nothing fails, nothing leaks.

    That the drain ended only after A served the request is read from A itself, the moment
    it answered "empty": the tokens its engine had decoded by then. The client's own answer
    comes later, through the gateway, and under load it may lag the drain's end."""
    p, a, b = workers
    decoded_before = _decoded(a)
    with gateway(smollm2_dir, [a.address, b.address], [p.address], tmp_path / "gw1.log",
                 "--health-interval", "3600") as url, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_complete, url, STORY)  # both idle: A, the first in the list, takes it
        wait_until(lambda: _admitted_remote(a, 1), 60, "A admitting the request for remote prefill")

        answers: list[pb.DrainResponse] = []
        idle_by_stats: list[bool] = []
        decoded_when_empty: list[float] = []

        def ask():
            s = a.stats()
            idle_by_stats.append(s.running_requests == 0 and s.waiting_requests == 0)
            answers.append(a.stub.Drain(pb.DrainRequest(), timeout=30))
            holdings = holdings_of(answers[-1])
            if holdings.empty:
                decoded_when_empty.append(_decoded(a) - decoded_before)
            return holdings

        def healthy() -> bool:
            return a.stub.Health(pb.HealthRequest(deep=True), timeout=30).ok

        drained = pool.submit(drain, ask, a.alive, healthy, bound_s=300, health_interval_s=2, unhealthy_after=3)
        # A gateway that still routes to A (it never heard of the drain) sends a request there.
        wait_until(lambda: answers, 30, "the first Drain answer")
        with gateway(smollm2_dir, [a.address, b.address], [p.address], tmp_path / "gw2.log",
                     "--health-interval", "3600") as url2:
            second = _complete(url2, "The capital of France is")
        assert second.status_code == 200, second.text
        assert f"decode worker {a.address} unavailable" in (tmp_path / "gw2.log").read_text()

        result = drained.result(timeout=300)
        resp = first.result(timeout=EXIT_GUARD_S)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length", resp.text
    assert result.end is DrainEnd.EMPTY and result.last.empty, result
    # A decoded every token past the prefill worker's first before it said it held nothing.
    assert decoded_when_empty and decoded_when_empty[0] >= MAX_TOKENS - 1, \
        ("the drain ended while A still served its request", decoded_when_empty)
    assert "retrying on another" not in (tmp_path / "gw1.log").read_text(), "the first request left A"
    # The old drain's view: idle by Stats while the request's KV was on its way.
    awaiting = [i for i, r in enumerate(answers) if r.awaiting_kv > 0]
    assert awaiting and any(idle_by_stats[i] for i in awaiting), (answers[:3], idle_by_stats[:3])
    _assert_idle(p, b)
    _sigterm_exits_cleanly(a)


def test_a_decode_worker_stopped_before_the_first_token_costs_a_retry_not_the_request(workers, smollm2_dir,
                                                                                       tmp_path):
    """SIGTERM to a decode worker whose request still waits for its remote KV: the worker
    ends it with an error before any token, and the gateway serves it on the other decode
    worker, with the tokens it gives when nothing fails."""
    p, _, b = workers
    (c,) = start_workers([("decode", ARGS, {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [b.address], [p.address], tmp_path / "ref.log") as url:
            want = _complete(url, STORY)
        assert want.status_code == 200, want.text
        # Routing as before the prefix index: B holds STORY's blocks now, and the index would send it there.
        with gateway(smollm2_dir, [c.address, b.address], [p.address], tmp_path / "gw.log",
                     "--health-interval", "3600", "--no-prefix-routing") as url, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            got = pool.submit(_complete, url, STORY)
            wait_until(lambda: _admitted_remote(c, 1), 60, "C admitting the request for remote prefill")
            _sigterm_exits_cleanly(c)
            resp = got.result(timeout=EXIT_GUARD_S)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        log = (tmp_path / "gw.log").read_text()
        assert f"decode worker {c.address} unavailable, retrying on another: decode worker failed the request: " \
               "worker shutting down" in log, log[-2000:]
        assert "requests still held at SIGTERM: ending them" in c.log_path.read_text()
        _assert_idle(p, b)
    finally:
        c.stop()


def test_a_drain_that_hands_off_ends_in_steps_and_its_streams_go_on_exactly(workers, smollm2_dir, tmp_path):
    """Long greedy streams on D; D leaves the membership and is drained with hand_off: it
    ends each request with HANDED_OFF and keeps its KV, the gateway replays each on B from
    the tokens it streamed naming D as its KV source, B copies the KV from D over NIXL (no
    prefill: there is no prefill worker, and B computes none), and the drain ends while the
    streams still run there. Every stream gives exactly the text it gives when left alone,
    with no error event."""
    _, _, b = workers
    (d,) = start_workers([("decode", ARGS, {})], smollm2_dir, tmp_path)
    bodies = [{"model": "smollm2", "prompt": f"Story number {i}: the sea was", "max_tokens": 200, "temperature": 0,
               "logit_bias": {"2": -100}, "stream": True} for i in range(4)]

    def read(url: str, body: dict, started: threading.Event | None = None) -> str:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as resp:
            assert resp.status_code == 200
            events = []
            for line in data_lines(resp.iter_lines()):
                if line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                if started is not None and len(events) == 3:
                    started.set()
        assert not any("error" in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length", \
            events[-2:]
        return "".join(e["choices"][0]["text"] for e in events)

    try:
        with gateway(smollm2_dir, [b.address], [], tmp_path / "ref.log") as ref:
            want = [read(ref, body) for body in bodies]
        log = tmp_path / "gateway.log"
        with admin_gateway(smollm2_dir, [d.address], [], log, ADMIN_TOKEN, "--health-interval", "3600") \
                as (url, members), concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            before = httpx.get(f"{url}/metrics", timeout=30).text
            started = [threading.Event() for _ in bodies]
            streams = [pool.submit(read, url, body, event) for body, event in zip(bodies, started)]
            for event in started:
                assert event.wait(120)
            members([b.address], [])  # the controller's first move: out of the membership

            def ask():
                return holdings_of(d.stub.Drain(pb.DrainRequest(hand_off=True), timeout=30))

            result = drain(ask, d.alive, lambda: True, bound_s=300, health_interval_s=2, unhealthy_after=3)
            assert result.end is DrainEnd.EMPTY, result
            assert not all(s.done() for s in streams), "the drain waited for the streams to end"
            assert [s.result(timeout=180) for s in streams] == want
            after = httpx.get(f"{url}/metrics", timeout=30).text
        assert log.read_text().count(f"handed it off (handed off: ") == len(bodies), log.read_text()[-3000:]
        d_log, b_log = d.log_path.read_text(errors="replace"), b.log_path.read_text(errors="replace")
        assert d_log.count("kept KV pushed to its taker") == len(bodies), d_log[-3000:]
        assert b_log.count(f"KV from {d.address}") == len(bodies), b_log[-3000:]
        assert "prefilling locally" not in b_log and '"event":"local_prefill"' not in b_log
        assert metric_value(after, "pdserve_decode_retries_total", when="handed_off") == \
            metric_value(before, "pdserve_decode_retries_total", when="handed_off") + len(bodies)
        _sigterm_exits_cleanly(d)
        _assert_idle(b)
    finally:
        d.stop()
