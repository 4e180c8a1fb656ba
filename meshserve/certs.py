"""A development certificate authority and one certificate per mesh role
(``meshserve certs DIR``), made with the ``cryptography`` library.

The naming scheme, which operators follow to issue their own certificates:

- ``DIR/ca.pem``: the CA every service trusts (``--tls-ca``).
- ``DIR/<role>.pem`` and ``DIR/<role>-key.pem`` for each role in ``ROLES``
  (``--tls-cert``, ``--tls-key``).
- A role is carried by exactly one URI subject alternative name
  ``spiffe://meshserve/<role>`` (``role_uri``); that, and nothing else in the
  certificate, is what a service's role check reads (``meshserve.authz``).
- The DNS and IP SANs are for hostname verification of the addresses peers dial:
  ``localhost``, ``127.0.0.1``, ``::1`` and the role's own name (the service names
  of ``deploy/docker-compose.yml``), plus any ``extra_hosts``.

Keys are ECDSA P-256; certificates are valid for ``valid_days`` (default 365).
The CA's key (``DIR/ca-key.pem``) stays in DIR: a development CA only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("gateway", "scheduler", "executor", "kvstore", "client")
ROLE_URI_PREFIX = "spiffe://meshserve/"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def role_uri(role: str) -> str:
    """The URI SAN that names ``role`` in a certificate."""
    return ROLE_URI_PREFIX + role


@dataclass(frozen=True)
class RolePaths:
    """Where one role's files live in a certificate directory."""

    ca: Path
    cert: Path
    key: Path


def role_paths(directory: str | os.PathLike, role: str) -> RolePaths:
    """``DIR/ca.pem``, ``DIR/<role>.pem`` and ``DIR/<role>-key.pem``."""
    d = Path(directory)
    return RolePaths(d / "ca.pem", d / f"{role}.pem", d / f"{role}-key.pem")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # ordered, no duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_ca(common_name: str = "meshserve development CA", valid_days: int = 365):
    """A self-signed CA: ``(key, certificate)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key, ca_cert: x509.Certificate, role: str, hosts: Sequence[str] = DEFAULT_HOSTS,
          valid_days: int = 365):
    """A certificate for ``role`` signed by the CA, usable as TLS server and client:
    ``(key, certificate)``; SANs: ``role_uri(role)`` and ``hosts`` (DNS names or IPs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshserve {role}")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(role_uri(role)), *_san(hosts)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def check_extra_hosts(extra_hosts: Sequence[str]) -> None:
    """Raises ``ValueError`` for an extra host that is a role's name: every certificate
    would carry it, and the gateway knows an executor by the name ``executor`` alone
    (``gateway.mesh_client.EXECUTOR_TLS_NAME``)."""
    taken = [h for h in extra_hosts if h.strip().lower().rstrip(".") in ROLES]
    if taken:
        raise ValueError(f"--host {taken[0]} is a role's name, which only that role's certificate carries (the "
                         f"gateway knows an executor by the name 'executor'); every certificate gets the --host names")


def write_certs(directory: str | os.PathLike, roles: Sequence[str] = ROLES, extra_hosts: Sequence[str] = (),
                valid_days: int = 365) -> list[Path]:
    """Makes a new CA in ``directory`` (created if missing) and one certificate per role;
    each role's hosts are ``DEFAULT_HOSTS``, the role's name and ``extra_hosts``.
    Returns the files written.

    Raises:
        ValueError: an unknown role; an extra host that is a role's name (every
            certificate would carry it, and the gateway knows an executor by the name
            ``executor`` alone: ``gateway.mesh_client.EXECUTOR_TLS_NAME``); or
            ``directory`` already holds a ``ca.pem`` (never overwritten: certificates
            issued from it would stop verifying).
    """
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown role(s) {', '.join(unknown)} (roles: {', '.join(ROLES)})")
    check_extra_hosts(extra_hosts)
    d = Path(directory)
    if (d / "ca.pem").exists():
        raise ValueError(f"{d / 'ca.pem'} exists; choose an empty directory")
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(valid_days=valid_days)
    written = [d / "ca.pem", d / "ca-key.pem"]
    _write(written[0], ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(written[1], _key_pem(ca_key), private=True)
    for role in roles:
        key, cert = issue(ca_key, ca_cert, role, [*DEFAULT_HOSTS, role, *extra_hosts], valid_days)
        paths = role_paths(d, role)
        _write(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
        _write(paths.key, _key_pem(key), private=True)
        written += [paths.cert, paths.key]
    return written


def has_certs(directory: str | os.PathLike, roles: Sequence[str] = ROLES) -> bool:
    """True when ``directory`` holds the CA and every role's certificate and key."""
    paths = [role_paths(directory, role) for role in roles]
    return all(f.is_file() for p in paths for f in (p.ca, p.cert, p.key))
