"""The gateway's admin routes (the deploy controller's membership push) live on a socket of
their own, bound to 127.0.0.1: the client-facing port does not serve them, whatever token
is sent, and the admin socket serves nothing else."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.test_gateway import gateway

ADMIN_TOKEN = "admin-token-for-the-test"


@pytest.fixture
def admin_gateway(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", ADMIN_TOKEN)
    log = tmp_path / "gateway.log"
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
