"""Mutual TLS on the internal gRPC (rpc/transport.py) from a deployment's own CA
(deploy/internal_ca.py): a server that has the deployment's certificate takes only clients
presenting one from the same CA, and every channel pdserve opens presents it and checks the
server's; a plain client, a client of another deployment and one with no certificate are
refused. Without the variables everything stays plain, as workers started by hand are."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from bench.harness.worker_procs import free_port
from common import envs
from deploy.internal_ca import make_internal_tls
from rpc import auth, transport


def _echo(request: bytes, context) -> bytes:
    return b"echo:" + request


@pytest.fixture()
def deployment_tls(monkeypatch):
    tls = make_internal_tls()
    for name, value in tls.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(envs.INTERNAL_TOKEN, raising=False)
    return tls


def _server() -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=auth.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(_echo)}),))
    port = free_port()
    assert transport.add_port(server, f"127.0.0.1:{port}") == port
    server.start()
    return server, f"127.0.0.1:{port}"


def _call(ch: grpc.Channel) -> bytes:
    return ch.unary_unary("/test.Echo/Call")(b"hi", timeout=10)


def test_members_talk_and_strangers_are_refused(deployment_tls, monkeypatch):
    server, address = _server()
    try:
        with auth.channel(address) as ch:  # what the gateway, the controller and the workers open
            assert _call(ch) == b"echo:hi"
        refused = []
        with grpc.insecure_channel(address) as plain:
            refused.append(pytest.raises(grpc.RpcError, _call, plain).value)
        other = make_internal_tls()  # another deployment's CA and certificate
        options = [("grpc.ssl_target_name_override", transport.INTERNAL_NAME)]
        stranger = grpc.ssl_channel_credentials(root_certificates=deployment_tls.ca, private_key=other.key,
                                                certificate_chain=other.cert)
        no_cert = grpc.ssl_channel_credentials(root_certificates=deployment_tls.ca)
        for credentials in (stranger, no_cert):
            with grpc.secure_channel(address, credentials, options=options) as ch:
                refused.append(pytest.raises(grpc.RpcError, _call, ch).value)
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE for e in refused), [e.code() for e in refused]
        for name in envs.INTERNAL_TLS_CA, envs.INTERNAL_TLS_CERT, envs.INTERNAL_TLS_KEY:
            monkeypatch.setenv(name, other.env()[name])  # a member of the other deployment
        with auth.channel(address) as ch:  # checks the server: not its CA's
            assert pytest.raises(grpc.RpcError, _call, ch).value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_without_the_variables_connections_stay_plain(monkeypatch):
    for name in envs.INTERNAL_TLS_CA, envs.INTERNAL_TLS_CERT, envs.INTERNAL_TLS_KEY:
        monkeypatch.delenv(name, raising=False)
    assert not transport.enabled()
    server, address = _server()
    try:
        with grpc.insecure_channel(address) as plain:
            assert _call(plain) == b"echo:hi"
    finally:
        server.stop(0)
