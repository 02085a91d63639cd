"""Who may read /metrics on the client port.

The scrape names every worker, its role and address-derived labels, the load, the SLO and
each tenant's refusals: on a gateway that only its own host reaches (a loopback bind) it is
open, as a Prometheus target usually is. On an address other machines reach it needs the
deployment's admin token (`PDSERVE_ADMIN_TOKEN`, sent as `Authorization: Bearer <token>`),
except from the gateway's own host (a loopback peer: the deploy planner's scrape, a
node-local agent), which could reach the admin socket too. With no admin token set, an
off-loopback /metrics answers such callers 403 and says how to open it.

A request relayed by a proxy (it carries X-Forwarded-For, Forwarded or X-Real-IP) gets
neither exemption from its proxy's address: a gateway bound to loopback behind a same-host
proxy would otherwise serve the scrape to anyone the proxy lets in. Through a trusted proxy
(`--forwarded-allow-ips`, gateway/front_door/trusted_proxies.py) the address the proxy names decides,
as a direct peer's would; through any other, the token is needed.
"""

from __future__ import annotations

import hmac

from gateway.errors import APIError
from gateway.front_door.trusted_proxies import Relay
from rpc.auth import is_loopback


def metrics_refusal(bind_host: str, peer_host: str | None, authorization: str | None,
                    admin_token: str | None, relay: Relay = Relay.DIRECT) -> APIError | None:
    """Why this caller may not read /metrics (401 or 403), or None if it may. `peer_host`:
    the client's address (the one a trusted proxy names, when `relay` is TRUSTED)."""
    local_peer = peer_host is not None and is_loopback(peer_host)
    if relay is Relay.DIRECT and (is_loopback(bind_host) or local_peer):
        return None
    if relay is Relay.TRUSTED and local_peer:
        return None
    if not admin_token:
        return APIError(403, f"/metrics on {bind_host} is served to other hosts only with the admin token: set "
                             "PDSERVE_ADMIN_TOKEN and send it as 'Authorization: Bearer <token>', or scrape from "
                             "the gateway's own host", code="forbidden")
    token = (authorization or "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(token.encode(), admin_token.encode()):
        return APIError(401, "/metrics from another host needs the deployment's admin token "
                             "('Authorization: Bearer <token>')", code="invalid_api_key")
    return None
