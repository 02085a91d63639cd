"""A request's trace: every process on its path (gateway, decode worker, prefill worker, real
processes of the gateway tests' 1P+1D deployment) logs its events, and `pdserve trace`
joins them into one timeline whose parts add up to the TTFT the gateway saw."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx

from bench.harness.worker_procs import REPO
from deploy.observe.trace import TraceEvent, Timeline, log_files, timelines

GATEWAY = ["arrived", "admitted", "sent", "first_token", "finished"]
DECODE = ["arrived", "admitted", "scheduled", "prefill_sent", "kv_ready", "first_token", "finished"]
PREFILL = ["arrived", "scheduled", "computed", "push_posted", "replied"]


def _stream(url: str, client_id: str, prompt: str) -> tuple[float, str, dict[str, str]]:
    """A streamed completion, read to its end; (seconds from sending it to its first token's
    chunk, its id, its x-pdserve-* headers: how it was served)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}
    ttft, rid = None, None
    t0 = time.time()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": client_id},
                      timeout=120) as r:
        assert r.status_code == 200
        served = {k: v for k, v in r.headers.items() if k.startswith("x-pdserve-")}
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttft, rid = time.time() - t0, chunk["id"]
    assert ttft is not None, "no token came"
    return ttft, rid, served


def _first(line: Timeline, role: str, name: str) -> TraceEvent:
    found = [e for e in line.events if e.role == role and e.name == name]
    assert found, f"no {role} {name} in {[(e.role, e.name) for e in line.events]}"
    return found[0]


def _wait_for_finish(logs, client_id: str) -> Timeline:
    """The timeline once every process has logged the request's end (a worker's last lines
    may land a moment after the answer)."""
    deadline = time.monotonic() + 60
    while True:
        found = timelines(log_files([logs]), client_id)
        names = {(e.role, e.name) for e in found[0].events} if found else set()
        if {("gateway", "finished"), ("decode", "finished"), ("prefill", "replied")} <= names:
            return found[0]
        assert time.monotonic() < deadline, names
        time.sleep(0.1)


def test_a_disaggregated_request_has_one_timeline_across_its_three_processes(system):
    url, prefill, decode = system
    logs = decode.log_path.parent
    client_id = f"trace-{uuid.uuid4().hex[:8]}"
    client_ttft, rid, served = _stream(url, client_id, f"{client_id}: tell me about the tides of the northern seas")
    line = _wait_for_finish(logs, client_id)
    assert line.request_id == rid and line.client_request_id == client_id
    for role, names in (("gateway", GATEWAY), ("decode", DECODE), ("prefill", PREFILL)):
        got = [e.name for e in line.events if e.role == role]
        assert all(n in got for n in names), (role, got)
    # Causal order across the processes (one host: one clock).
    chain = [("gateway", "arrived"), ("gateway", "sent"), ("decode", "arrived"), ("decode", "prefill_sent"),
             ("prefill", "arrived"), ("prefill", "scheduled"), ("prefill", "computed"), ("prefill", "replied"),
             ("decode", "kv_ready"), ("decode", "first_token"), ("gateway", "first_token")]
    times = [_first(line, *step).t for step in chain]
    assert times == sorted(times), list(zip(chain, times))
    # The parts are the intervals between consecutive events: they add up to the gateway's
    # TTFT, which lies within what the client measured (it sent before the gateway saw the
    # request and read the first token after the gateway had it).
    assert abs(sum(b.t - a.t for a, b in line.parts) - line.ttft_s) < 1e-6
    assert 0 < line.ttft_s <= client_ttft
    kv = _first(line, "decode", "kv_ready").fields
    assert kv["prefill_worker"] == prefill.address and kv["prefill_compute_s"] > 0
    # How it was served, as its headers said: the same facts, from the gateway's first_token
    # event; the trace names workers by address (the admin side's), the headers by name.
    names = {decode.address: decode.name, prefill.address: prefill.name}
    assert {f"x-pdserve-{k.replace('_', '-')}": names.get(str(v), str(v)) for k, v in line.served.items()} == served
    assert line.served["prefill"] == "remote" and line.served["kv_blocks"] == kv["blocks"] > 0
    assert line.served["prefill_worker"] == prefill.address and line.served["decode_worker"] == decode.address

    out = subprocess.run([sys.executable, "-m", "deploy.cli", "trace", client_id, "--logs", str(logs)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"request {rid} (X-Request-Id {client_id})" in out.stdout and "TTFT" in out.stdout
    assert (f"served: decode_worker={decode.address} prefill=remote prefill_worker={prefill.address} "
            f"kv_blocks={kv['blocks']} cached_tokens=0") in out.stdout, out.stdout
    for name in ("kv_ready", "push_posted", "computed"):
        assert name in out.stdout
    as_json = subprocess.run([sys.executable, "-m", "deploy.cli", "trace", rid, "--logs", str(logs), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    [parsed] = json.loads(as_json.stdout)
    assert parsed["request_id"] == rid and abs(parsed["ttft_s"] - line.ttft_s) < 1e-9
    assert parsed["served"] == line.served
    missing = subprocess.run([sys.executable, "-m", "deploy.cli", "trace", "no-such-request", "--logs", str(logs)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no trace events of 'no-such-request'" in missing.stderr


def test_a_timeline_joins_retries_and_each_request_a_client_id_named(tmp_path):
    """A decode worker retried under ID-retry is the same request; a client id used twice
    names two requests, each its own timeline; lines cut short are skipped."""
    def line(t: float, rid: str, proc: str, event: str, **fields) -> str:
        rec = {"t": t, "rid": rid, "proc": proc, "event": event, **fields}
        return f"2026-12-03 06:00:00,000 INFO pdserve.trace: {json.dumps(rec)}\n"

    (tmp_path / "gateway.log").write_text(
        line(10.0, "cmpl-a", "gateway g", "arrived", client_request_id="c")
        + line(10.001, "cmpl-a", "gateway g", "sent") + line(10.05, "cmpl-a", "gateway g", "first_token")
        + line(20.0, "cmpl-b", "gateway g", "arrived", client_request_id="c")
        + '2026-12-03 06:00:00,000 INFO pdserve.trace: {"t": 20.1, "rid": "cmpl-b"\n')
    (tmp_path / "decode.log.1").write_text(
        line(10.002, "cmpl-a", "decode d", "arrived") + line(10.003, "cmpl-a-retry", "decode d", "arrived")
        + line(10.04, "cmpl-a-retry", "decode d", "first_token") + line(10.5, "cmpl-ab", "decode d", "arrived"))
    a, b = timelines(log_files([tmp_path]), "c")
    assert a.request_id == "cmpl-a" and [e.name for e in a.events] == [
        "arrived", "sent", "arrived", "arrived", "first_token", "first_token"]
    assert abs(a.ttft_s - 0.05) < 1e-9 and len(a.parts) == 5
    assert b.request_id == "cmpl-b" and b.ttft_s is None and "no TTFT" in b.render()
