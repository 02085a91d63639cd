"""Where the gateway may listen without API keys: loopback only, unless the operator says so.

An open gateway (no tenants file) on an address other machines reach serves the model to
anyone who finds it. Refused at start-up, by the gateway itself and by the deployment
config, unless the operator opts in with a flag that names the risk.
"""

from __future__ import annotations

from rpc.auth import is_loopback

OPT_IN_FLAG = "--insecure-no-api-keys"


def open_bind_refusal(host: str, has_keys: bool, opted_in: bool) -> str | None:
    """Why this bind is refused, or None if it is allowed."""
    if has_keys or opted_in or is_loopback(host):
        return None
    return (f"refusing to serve on {host} without API keys: anyone who can reach it could use the model. "
            f"Give a tenants file of API keys, bind 127.0.0.1, or accept the risk with {OPT_IN_FLAG}")
