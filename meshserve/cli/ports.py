"""Loopback TCP ports for the processes the CLI starts: whether one is free, and a free one.

``meshserve up`` checks the ports it was given before it starts anything and picks
free ones for the services it places itself (``meshserve.cli.launcher.Mesh``);
``meshserve executor`` checks its own before the model loads
(``meshserve.cli.services``). A port is free as gRPC's servers see it: they bind with
SO_REUSEADDR, so the TIME-WAIT connections of a mesh just stopped do not hold it.
A port found free may still be taken before it is bound.
"""

from __future__ import annotations

import socket


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a TCP listener could bind ``host:port`` now (as gRPC's servers bind:
    with SO_REUSEADDR, so the TIME-WAIT connections of a mesh just stopped do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
