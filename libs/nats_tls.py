"""TLS material a stack issues for its nats-server: a private CA, a server pair and a client pair.

``python -m libs.nats_tls DIR [HOST ...]`` writes them to DIR (the documented command for a
stack that brings its own files); the local stacks call ``issue_tls`` directly.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.nats_auth import TlsFiles

_VALID_DAYS = 825


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Sluice stack"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


_Pair = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          usage: x509.ObjectIdentifier, hosts: list[str]) -> _Pair:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def issue_tls(directory: Path, hosts: list[str] | None = None) -> TlsFiles:
    """A CA, a server certificate for ``hosts`` (default: 127.0.0.1 and localhost) and a client
    certificate, as PEM files in ``directory``. Keys are written 0600."""
    hosts = hosts or ["127.0.0.1", "localhost"]
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (x509.CertificateBuilder().subject_name(_name("Sluice stack CA"))
               .issuer_name(_name("Sluice stack CA")).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_key, server_cert = _leaf(ca_key, ca_cert, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, hosts)
    client_key, client_cert = _leaf(ca_key, ca_cert, "sluice-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    files = TlsFiles(ca=directory / "ca.pem", server_cert=directory / "server.pem",
                     server_key=directory / "server-key.pem", client_cert=directory / "client.pem",
                     client_key=directory / "client-key.pem")
    _write_cert(ca_cert, files.ca)
    _write_cert(server_cert, files.server_cert)
    _write_key(server_key, files.server_key)
    _write_cert(client_cert, files.client_cert)
    _write_key(client_key, files.client_key)
    return files


def client_context(ca_file: str | None, cert_file: str | None = None,
                   key_file: str | None = None) -> ssl.SSLContext:
    """A client context trusting ``ca_file`` (the system's roots without it), presenting the
    client pair when given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m libs.nats_tls DIR [HOST ...]")
    out = issue_tls(Path(sys.argv[1]), sys.argv[2:] or None)
    print(f"wrote {out.ca}, {out.server_cert}, {out.server_key}, {out.client_cert}, {out.client_key}")
