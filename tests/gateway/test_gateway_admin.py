"""The gateway's admin routes (the deploy controller's membership push) live on a socket of
their own, bound to 127.0.0.1: the client-facing port does not serve them, whatever token
is sent, and the admin socket serves nothing else."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import start_workers, wait_until

ADMIN_TOKEN = "admin-token-for-the-test"


@pytest.fixture
def admin_gateway(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", ADMIN_TOKEN)
    log = tmp_path / "gateway.log"  # tests read it
    with gateway(smollm2_dir, [], [], log) as url:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"^admin on (\S+):(\d+)$", log.read_text(), re.MULTILINE)):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        yield url, f"http://{m.group(1)}:{m.group(2)}"


def test_the_admin_routes_are_served_only_on_the_loopback_admin_socket(admin_gateway):
    url, admin = admin_gateway
    assert admin.startswith("http://127.0.0.1:") and admin != url
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    members = {"decode": ["127.0.0.1:1"], "prefill": []}
    public = httpx.put(f"{url}/admin/workers", json=members, headers=auth, timeout=10)
    assert public.status_code == 404 and public.json()["error"]["code"] == "not_found", public.text
    assert httpx.get(f"{url}/admin/workers", headers=auth, timeout=10).status_code == 404
    assert httpx.put(f"{admin}/admin/workers", json=members, headers={"Authorization": "Bearer wrong"},
                     timeout=10).status_code == 401
    pushed = httpx.put(f"{admin}/admin/workers", json=members, headers=auth, timeout=10)
    assert pushed.status_code == 200 and pushed.json()["decode"] == ["127.0.0.1:1"], pushed.text
    listed = httpx.get(f"{admin}/admin/workers", headers=auth, timeout=10).json()
    assert [w["address"] for w in listed["decode"]] == ["127.0.0.1:1"]
    for path in ("/health", "/v1/models", "/metrics"):  # the admin socket is for /admin/* alone
        assert httpx.get(f"{admin}{path}", timeout=10).status_code == 404, path
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_a_decode_worker_leaving_the_membership_finishes_its_streams(admin_gateway, smollm2_dir, tmp_path):
    """Scale-down takes a decode worker out of the gateway's membership while it streams: no
    new request goes to it, but its running streams are served to their end (the deploy
    controller's drain bounds how long), and only then is its channel closed."""
    url, admin = admin_gateway
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    (d,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "256"], {})], smollm2_dir, tmp_path)
    try:
        assert httpx.put(f"{admin}/admin/workers", json={"decode": [d.address], "prefill": []}, headers=auth,
                         timeout=10).status_code == 200
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            next(lines)
            left = httpx.put(f"{admin}/admin/workers", json={"decode": [], "prefill": []}, headers=auth, timeout=10)
            assert left.status_code == 200, left.text
            refused = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": "Hi"}, timeout=30)
            assert refused.status_code == 503, refused.text  # nobody new goes to it
            rest = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        assert "error" not in rest[-1], rest[-1]
        assert rest[-1]["usage"]["completion_tokens"] == 400 and rest[-2]["choices"][0]["finish_reason"] == "length"
        log = tmp_path / "gateway.log"
        wait_until(lambda: f"channel to {d.address} closed" in log.read_text(), 30, "the channel closed")
    finally:
        d.stop()
