"""How internal gRPC connections are made: plain, or mutual TLS from the deployment's own CA.

When the deployment hands its processes a CA and a certificate (PDSERVE_INTERNAL_TLS_CA,
_CERT, _KEY: PEM, made by deploy/internal_ca.py when `pdserve serve` joins a cluster, where
gRPC crosses nodes), every worker's server takes only TLS connections whose client presents
a certificate from that CA, and every channel the gateway, the controller and the workers
open checks the server's certificate against it: the two ends prove they belong to the
deployment both ways, and the calls (requests, tokens, the KV handshake's metadata) are
encrypted. The certificate names `INTERNAL_NAME`, not a host: processes move between nodes,
and every channel checks that name whatever address it dials. Without the variables
(workers started by hand, an embedded deployment on one host's loopback) connections are
plain and the internal token (rpc/auth.py) is the only check.

What this does not cover: NIXL's data path (the KV blocks themselves, UCX over RDMA, TCP
or shared memory) is not encrypted by it; NIXL peers learn each other from metadata carried
in these calls, so only members of the deployment are handed an agent to talk to, but the
KV bytes cross the wire in the clear. Keep the nodes' data network private.
"""

from __future__ import annotations

import grpc
from grpc import aio

from common import envs

INTERNAL_NAME = "pdserve-internal"  # the name every internal certificate carries, and every channel checks


def _material() -> tuple[bytes, bytes, bytes] | None:
    return envs.internal_tls()


def enabled() -> bool:
    return _material() is not None


def _channel_credentials() -> grpc.ChannelCredentials:
    ca, cert, key = _material()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel(address: str, options: list[tuple[str, object]]) -> grpc.Channel:
    """A channel to `address`: mutual TLS when the deployment has its CA, else plain."""
    if not enabled():
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, _channel_credentials(),
                               options=[*options, ("grpc.ssl_target_name_override", INTERNAL_NAME)])


def aio_channel(address: str, options: list[tuple[str, object]], interceptors=None) -> aio.Channel:
    if not enabled():
        return aio.insecure_channel(address, options=options, interceptors=interceptors)
    return aio.secure_channel(address, _channel_credentials(),
                              options=[*options, ("grpc.ssl_target_name_override", INTERNAL_NAME)],
                              interceptors=interceptors)


def add_port(server: grpc.Server, address: str) -> int:
    """Listen on `address` (the port bound, 0 on failure): with the deployment's CA, TLS
    that requires a client certificate from it."""
    if not enabled():
        return server.add_insecure_port(address)
    ca, cert, key = _material()
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(address, credentials)
