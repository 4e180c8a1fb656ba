"""Certificates for tests over real TLS on loopback: one development CA and a
certificate per role (``meshserve certs``), made once per test process in a
temporary directory, and a second, foreign CA for the refusal tests."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

from meshserve.certs import write_certs
from meshserve.tls import TLSConfig


@cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="meshserve-test-certs-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def cert_dir(name: str = "mesh") -> Path:
    """A directory holding ``ca.pem`` and every role's certificate and key; each
    ``name`` has its own CA (``"foreign"``: one the mesh does not trust)."""
    d = _root() / name
    if not d.exists():
        write_certs(d)
    return d


def role_tls(role: str, name: str = "mesh") -> TLSConfig:
    """The TLS settings of ``role`` under the CA ``name`` (see ``cert_dir``)."""
    return TLSConfig.from_dir(cert_dir(name), role)
