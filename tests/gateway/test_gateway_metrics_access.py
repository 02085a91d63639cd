"""/metrics on the client port: open on a loopback bind (and to the gateway's own host),
behind the admin token when the gateway listens where other machines reach it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import GatewayConfig, create_app
from gateway.front_door.metrics_access import metrics_refusal
from gateway.front_door.trusted_proxies import Relay

TOKEN = "admin-token-for-the-test"
REMOTE = "203.0.113.7"  # a documentation address: another machine


@pytest.mark.parametrize("bind,peer,auth,token,status", [
    ("127.0.0.1", REMOTE, None, None, None),  # a loopback bind: open (only its own host reaches it)
    ("localhost", REMOTE, None, TOKEN, None),
    ("0.0.0.0", "127.0.0.1", None, TOKEN, None),  # off loopback, from its own host: open
    ("0.0.0.0", "::1", None, None, None),
    ("0.0.0.0", REMOTE, None, TOKEN, 401),  # from elsewhere: the admin token
    ("0.0.0.0", REMOTE, "Bearer wrong", TOKEN, 401),
    ("10.1.2.3", REMOTE, f"Bearer {TOKEN}", TOKEN, None),
    ("0.0.0.0", REMOTE, f"Bearer {TOKEN}", TOKEN, None),
    ("0.0.0.0", REMOTE, f"Bearer {TOKEN}", None, 403),  # no token set: nothing opens it from elsewhere
    ("0.0.0.0", None, None, TOKEN, 401),  # a peer of unknown address is not the gateway's own host
])
def test_who_may_read_metrics(bind, peer, auth, token, status):
    refusal = metrics_refusal(bind, peer, auth, token)
    assert (refusal.status if refusal else None) == status, refusal and refusal.message


@pytest.mark.parametrize("bind,client,relay,auth,status", [
    # behind a same-host proxy that is not trusted: its loopback address opens nothing
    ("127.0.0.1", "127.0.0.1", Relay.UNTRUSTED, None, 401),
    ("0.0.0.0", "127.0.0.1", Relay.UNTRUSTED, None, 401),
    ("127.0.0.1", "127.0.0.1", Relay.UNTRUSTED, f"Bearer {TOKEN}", None),
    # through a trusted proxy the address it names decides
    ("127.0.0.1", REMOTE, Relay.TRUSTED, None, 401),
    ("127.0.0.1", "127.0.0.1", Relay.TRUSTED, None, None),
    ("127.0.0.1", REMOTE, Relay.TRUSTED, f"Bearer {TOKEN}", None),
])
def test_a_proxied_request_gets_no_loopback_exemption_from_its_proxy(bind, client, relay, auth, status):
    refusal = metrics_refusal(bind, client, auth, TOKEN, relay)
    assert (refusal.status if refusal else None) == status, refusal and refusal.message


def _get_metrics(smollm2_dir, host: str, peer: str, headers: dict[str, str]) -> httpx.Response:
    """GET /metrics through the whole app (its middleware, its route), from `peer`."""
    config = GatewayConfig("smollm2", smollm2_dir, ["127.0.0.1:1"], host=host, admin_token=TOKEN)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(create_app(config), client=(peer, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
            return await c.get("/metrics", headers=headers, timeout=30)

    return asyncio.run(get())


def test_an_off_loopback_gateway_refuses_metrics_without_the_admin_token(smollm2_dir):
    refused = _get_metrics(smollm2_dir, "0.0.0.0", REMOTE, {})
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_api_key" and "admin token" in refused.json()["error"]["message"]
    assert "pdserve_" not in refused.text
    allowed = _get_metrics(smollm2_dir, "0.0.0.0", REMOTE, {"Authorization": f"Bearer {TOKEN}"})
    assert allowed.status_code == 200 and "pdserve_requests_total" in allowed.text, allowed.text[:300]
    on_loopback = _get_metrics(smollm2_dir, "127.0.0.1", REMOTE, {})
    assert on_loopback.status_code == 200 and "pdserve_requests_total" in on_loopback.text
    # a loopback gateway behind a same-host proxy (no --forwarded-allow-ips): the proxy's
    # request carries the client it relays, so its own loopback address opens nothing
    proxied = _get_metrics(smollm2_dir, "127.0.0.1", "127.0.0.1", {"X-Forwarded-For": REMOTE})
    assert proxied.status_code == 401 and "pdserve_" not in proxied.text, proxied.text[:300]
