"""A deployment whose decode worker is tensor-parallel (YAML `decode.tp_size: 3`, SmolLM2's
9 query and 3 KV heads) behind a prefill worker of one rank: Ray reserves the decode
worker's three ranks as one placement group, the prefill worker pushes each prompt's KV
into them (the answer's headers say so) and the greedy text equals one rank's; when one of
its ranks is killed (kill -9) the whole worker is replaced: the stream in flight ends with
an error event (never a hang), the old group's processes all end, and a new group serves
again, with its KV again from the prefill worker. The deployment serves over TLS
(`gateway.ssl_certfile`): the official openai client talks to it over https, as a client
of the seed's front door would, and plain HTTP on its port is refused; and its internal gRPC
is mutual TLS (`internal_tls: on`, as a deployment across nodes has it): the gateway, the
controller and the workers talk through it, a plain gRPC client gets nothing from a worker."""

from __future__ import annotations

import os
import signal

import grpc
import httpx
import psutil
import pytest
from openai import OpenAI

from bench.harness.certificates import self_signed
from bench.harness.deploy_procs import CHAT, deployment_status, serving, wait_for
from bench.harness.worker_procs import free_port
from common.sampling_params import SamplingParams
from engine import LLM
from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc


def _ranks(worker_pid: int) -> list[psutil.Process]:
    """The worker's other ranks: the processes it spawned (multiprocessing's resource tracker aside)."""
    return [p for p in psutil.Process(worker_pid).children()
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def test_a_tensor_parallel_decode_worker_serves_and_is_replaced_whole_when_a_rank_dies(smollm2_dir, tmp_path):
    with LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=64) as one:
        want = one.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0].text
    cert, key = self_signed(tmp_path / "tls")
    config = tmp_path / "tp.yaml"
    config.write_text("dtype: float32\nprefill: {replicas: 1, kv_blocks: 256}\n"
                      "decode: {replicas: 1, tp_size: 3, kv_blocks: 256}\n"
                      f"gateway: {{ssl_certfile: {cert}, ssl_keyfile: {key}}}\ninternal_tls: on\n")
    port = free_port()
    url, log = f"https://127.0.0.1:{port}", tmp_path / "serve.log"
    with serving(log, "--config", str(config), "--port", str(port), "--num-cpus", "4") as (_, address):
        assert f"at {url}/v1" in log.read_text()
        https = httpx.Client(verify=str(cert), timeout=120)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=https)
        _assert_served_remotely(client, want)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the port: refused
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert "internal gRPC: mutual TLS" in log.read_text()
        (prefill,) = deployment_status(address)["pools"]["prefill"]
        with grpc.insecure_channel(prefill["address"]) as plain:  # no certificate of the deployment's CA
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.WorkerStub(plain).Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value

        (before,) = deployment_status(address)["pools"]["decode"]
        ranks = _ranks(before["pid"])
        assert len(ranks) == 2, [p.cmdline() for p in psutil.Process(before["pid"]).children()]
        body = {"model": "smollm2", "messages": CHAT, "max_tokens": 300, "stream": True, "logit_bias": {"2": -100}}
        with https.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            assert "error" not in next(lines)
            os.kill(ranks[1].pid, signal.SIGKILL)  # rank 2 of the group
            rest = list(lines)  # ends: an error event, then [DONE]; never a hang
        assert rest[-1] == "data: [DONE]" and "error" in rest[-2], rest[-3:]
        _, alive = psutil.wait_procs([psutil.Process(before["pid"]), ranks[0]], timeout=30)
        assert not alive, "the rest of the old group outlived its killed rank"

        def replaced():
            (now,) = deployment_status(address)["pools"]["decode"]
            return now["state"] == "ready" and now["incarnation"] != before["incarnation"] and now
        after = wait_for(replaced, 180, "a new decode incarnation", log)
        assert after["restarts"] >= 1 and len(_ranks(after["pid"])) == 2
        assert "decode worker 0: its process exited (code 70: a tensor-parallel rank of the worker died)" \
            in log.read_text()

        def served():
            try:
                return _assert_served_remotely(client, want)
            except Exception:
                return None
        assert wait_for(served, 60, "serving after the replacement, KV from the prefill worker")


def _assert_served_remotely(client: OpenAI, want: str) -> bool:
    raw = client.chat.completions.with_raw_response.create(model="smollm2", messages=CHAT, max_tokens=12,
                                                           temperature=0)
    assert raw.parse().choices[0].message.content == want
    assert raw.headers["x-pdserve-prefill"] == "remote" and int(raw.headers["x-pdserve-kv-blocks"]) > 0, raw.headers
    return True
