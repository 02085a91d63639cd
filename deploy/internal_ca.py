"""A deployment's own certificate authority for its internal gRPC (rpc/transport.py).

`pdserve serve` makes one at start when gRPC crosses nodes: a CA key and certificate, and
one certificate it signs for the name rpc/transport.py `INTERNAL_NAME`, usable by servers
and clients alike, which every process of the deployment gets through its environment
(the controller's `child_env`, as the internal token is). The CA's key signs that one
certificate and is then dropped: nothing else can be issued, and a process started outside
the deployment holds nothing the CA signed. Valid for `days` (a deployment restarted makes
new ones).
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common import envs
from rpc.transport import INTERNAL_NAME


class InternalTls(NamedTuple):
    ca: bytes  # PEM
    cert: bytes
    key: bytes

    def env(self) -> dict[str, str]:
        """The variables that hand it to a process (common/envs.py `internal_tls`)."""
        return {envs.INTERNAL_TLS_CA: self.ca.decode(), envs.INTERNAL_TLS_CERT: self.cert.decode(),
                envs.INTERNAL_TLS_KEY: self.key.decode()}


def make_internal_tls(days: int = 365) -> InternalTls:
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve deployment CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, INTERNAL_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(INTERNAL_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return InternalTls(ca.public_bytes(pem), cert.public_bytes(pem),
                       key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
