"""A grpc.health.v1 probe for containers: ``python -m meshserve.healthcheck HOST:PORT``.

Exit status 0 when the service at HOST:PORT answers SERVING within the timeout,
1 otherwise (NOT_SERVING, unreachable, a handshake refused), as Docker's
``HEALTHCHECK`` and compose's ``healthcheck`` expect. With ``--tls-ca``,
``--tls-cert`` and ``--tls-key`` (PEM files, e.g. from ``meshserve certs``) it
connects over mutual TLS. Kubernetes needs no such program: its probes speak
grpc.health.v1 natively (deploy/k8s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0, tls: tuple[Path, Path, Path] | None = None) -> bool:
    """Whether ``address`` reports ``service`` ("" : the whole server) SERVING.

    Args:
        address: host:port.
        service: the health service name.
        timeout_s: the whole check's bound (seconds).
        tls: (CA, certificate, key) PEM paths for mutual TLS, or None (plaintext).
    """
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        ca, cert, key = (p.read_bytes() for p in tls)
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument("--service", default="", help="health service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", type=Path)
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    args = parser.parse_args(argv)
    paths = (args.tls_ca, args.tls_cert, args.tls_key)
    if any(paths) and not all(paths):
        parser.error("--tls-ca, --tls-cert and --tls-key go together")
    return 0 if check(args.address, args.service, args.timeout, paths if all(paths) else None) else 1


if __name__ == "__main__":
    sys.exit(main())
