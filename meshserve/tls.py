"""TLS settings of one process: its certificate and key, the CA it trusts, or plaintext.

One ``TLSConfig`` per process (per service in the in-process test mesh): the
service serves with its certificate and dials its peers with the same
certificate as its client identity, so a service's role is the same in both
directions. ``meshserve.grpc_server`` turns it into server credentials
(``Service``) and channel credentials (``open_channel``); nothing else in the
mesh makes a server port or a channel.

Flags (``from_flags``): ``--tls-cert``, ``--tls-key``, ``--tls-ca`` (all three:
mutual TLS), or ``--insecure`` (plaintext, asked for explicitly). Certificates
and the role they carry: ``meshserve.certs``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshserve.certs import role_paths


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS from PEM files, or plaintext.

    Attributes:
        cert: this process's certificate chain (PEM); None with ``insecure``.
        key: its private key (PEM).
        ca: the CA certificates that peers' certificates must chain to (PEM).
        insecure: plaintext, no identities, no role checks.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    insecure: bool = False

    @property
    def enabled(self) -> bool:
        """True for TLS, False for plaintext."""
        return not self.insecure

    @classmethod
    def plaintext(cls) -> TLSConfig:
        return cls(insecure=True)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike, role: str) -> TLSConfig:
        """``DIR/<role>.pem``, ``DIR/<role>-key.pem`` and ``DIR/ca.pem`` (``meshserve certs DIR``)."""
        p = role_paths(directory, role)
        return cls(str(p.cert), str(p.key), str(p.ca)).checked()

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, insecure: bool,
                   client: bool = False) -> TLSConfig:
        """The settings of a command's ``--tls-cert/--tls-key/--tls-ca/--insecure``.

        A service needs all three files or ``--insecure``. A client of the public
        gateway (``client``) may give only ``--tls-ca`` (TLS with no client
        certificate); with no flag at all it speaks plaintext.

        Raises:
            ValueError: ``--insecure`` with a TLS flag, a missing flag, or a file
                that cannot be read (one line naming the flag).
        """
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        named = [flag for flag, value in given.items() if value]
        if insecure:
            if named:
                raise ValueError(f"--insecure (plaintext) cannot be combined with {', '.join(named)}")
            return cls.plaintext()
        if client:
            if not named:
                return cls.plaintext()
            if not ca:
                raise ValueError("TLS to the gateway needs --tls-ca (the CA that signed its certificate)")
            if bool(cert) != bool(key):
                raise ValueError("a client certificate needs both --tls-cert and --tls-key")
            return cls(cert, key, ca).checked()
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"mutual TLS needs {', '.join(missing)} (a development set: `meshserve certs DIR`), "
                             f"or --insecure for plaintext")
        return cls(cert, key, ca).checked()

    def checked(self) -> TLSConfig:
        """Itself, once every file it names can be read.

        Raises:
            ValueError: a file is missing or unreadable.
        """
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: no such readable file")
        return self

    def _read(self) -> tuple[bytes | None, bytes | None, bytes]:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return read(self.key), read(self.cert), read(self.ca)

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """Credentials of a listening port: its certificate, and the CA that client
        certificates must chain to; with ``require_client_auth`` a caller without a
        valid client certificate fails the handshake (mutual TLS)."""
        key, cert, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel: the CA the server's certificate must chain to
        (and match the dialled host name), and this process's certificate as its
        client identity (when it has one)."""
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


PLAINTEXT = TLSConfig.plaintext()
