"""Who the client of a request is, when proxies stand in front of the gateway.

Behind an L7 proxy (TLS termination, a mesh's sidecar) every connection comes from the
proxy's address. `--forwarded-allow-ips` names the proxies the gateway trusts (addresses or
networks, comma-separated, or `*`); a request from one of them is attributed to the address
its `X-Forwarded-For` names: the right-most entry that is not itself a trusted proxy (each
proxy appends the address it received the request from, so entries to the left of an
untrusted one may have been written by the client and are ignored). A request from any other
peer is attributed to the peer, whatever headers it sends. With no trusted proxy (the
default) forwarding headers are never believed.

What is attributed this way: the per-address cap on stalled connections
(gateway/front_door/head_deadline.py), the ASGI scope's `client` (logs, /metrics access) and whether a
request came through a proxy at all (gateway/front_door/metrics_access.py: a proxied request never gets
the loopback exemption its proxy's address would).
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from collections.abc import Iterable

# The headers a proxy adds: their presence says a request was relayed, trusted or not.
FORWARDING_HEADERS = (b"x-forwarded-for", b"forwarded", b"x-real-ip")

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The set of proxy addresses whose `X-Forwarded-For` is believed."""

    def __init__(self, spec: str | None = None):
        """`spec`: comma-separated addresses or networks (`10.0.0.0/8`), `*` for any peer,
        empty or None for none. A malformed entry is a ValueError naming it."""
        self.spec = (spec or "").strip()
        self.any = self.spec == "*"
        self._networks: list[_Network] = []
        if not self.any:
            for entry in filter(None, (e.strip() for e in self.spec.split(","))):
                try:
                    self._networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"--forwarded-allow-ips: {entry!r} is not an IP address or network") from None
        self._trusts = functools.lru_cache(maxsize=4096)(self._compute)

    def __bool__(self) -> bool:
        return self.any or bool(self._networks)

    def trusts(self, host: str | None) -> bool:
        """Whether `host` (a peer address) is a trusted proxy."""
        if not host or not self:
            return False
        return self.any or self._trusts(host)

    def _compute(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self._networks)

    def client(self, peer: str | None, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The address a request from `peer` with these (lower-case) headers is attributed to."""
        if not self.trusts(peer):
            return peer
        forwarded = b",".join(v for k, v in headers if k == b"x-forwarded-for").decode("latin-1")
        hops = [h.strip() for h in forwarded.split(",") if h.strip()]
        for hop in reversed(hops):  # the right-most hop no trusted proxy wrote is the client
            if not self.trusts(hop):
                return hop
        return hops[0] if hops else peer  # every hop a trusted proxy: the first one is where it began


class Relay(enum.Enum):
    """How a request reached the gateway."""

    DIRECT = "direct"  # no forwarding header: the peer is the client
    TRUSTED = "trusted"  # through a trusted proxy: the client is the address it names
    UNTRUSTED = "untrusted"  # forwarding headers from a peer that is not a trusted proxy: the client is unknown


SCOPE_KEY = "pdserve.relay"  # where ForwardedClient leaves the Relay in the ASGI scope


def relay_of(peer: str | None, headers: Iterable[tuple[bytes, bytes]], proxies: TrustedProxies) -> Relay:
    if not any(k in FORWARDING_HEADERS for k, _ in headers):
        return Relay.DIRECT
    return Relay.TRUSTED if proxies.trusts(peer) else Relay.UNTRUSTED


class ForwardedClient:
    """ASGI middleware: the scope's `client` becomes the address the trusted proxies name
    (a request from another peer keeps its peer address), and `scope[SCOPE_KEY]` says how
    the request came (Relay)."""

    def __init__(self, app, proxies: TrustedProxies):
        self.app, self.proxies = app, proxies

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = scope.get("headers") or ()
            peer = scope.get("client")
            scope[SCOPE_KEY] = relay_of(peer[0] if peer else None, headers, self.proxies)
            if scope[SCOPE_KEY] is Relay.TRUSTED:
                host = self.proxies.client(peer[0], headers)
                if host != peer[0]:
                    scope["client"] = (host, 0)
        await self.app(scope, receive, send)
