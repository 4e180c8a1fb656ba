"""The HTTP server of the gateway: uvicorn serving ``gateway.http.app`` in the
gateway's own event loop, beside its gRPC server (one process, one core).

``HttpServer.start`` binds the port and returns once uvicorn listens; ``stop``
lets running requests finish for ``grace_s`` seconds, then closes the rest
(which cancels their core streams, freeing their KV blocks).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)


class HttpServer:
    """uvicorn over an ASGI app, in the running event loop.

    Args:
        app: the ASGI application.
        port: TCP port (0: a free one; ``port`` holds it once started).
        host: interface to listen on.
    """

    def __init__(self, app, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        # log_config None: uvicorn's lines go through the process's logging (its format, and in a local mesh
        # the service's name, meshserve.log_format), not through handlers of uvicorn's own
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, loop="none", log_config=None)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the gateway's process owns the signals
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """``host:port`` it listens on."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Its base URL (``http://host:port``)."""
        return f"http://{self.address}"

    async def start(self) -> None:
        """Binds and serves in a background task; returns once it listens.

        Raises:
            OSError: the port cannot be bound.
        """
        # proto IPPROTO_TCP (not the default 0): asyncio turns Nagle off (TCP_NODELAY) only on
        # accepted sockets whose proto says TCP, and uvicorn writes a response's head and body
        # apart, so with Nagle on each keep-alive response waited ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # bound here, so a busy port is an OSError (uvicorn would exit the process)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"http: cannot listen on {self.host}:{self.port} (port in use or not allowed); "
                          "choose one with --http-port") from exc
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what uvicorn raised
                raise OSError(f"http: uvicorn stopped during start-up on {self.address}")
            await asyncio.sleep(0.01)
        log.info("HTTP (OpenAI-compatible) on http://%s", self.address)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting, lets requests finish for ``grace_s``, then closes the rest."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        try:
            await self._task
        except (asyncio.CancelledError, SystemExit):
            pass
        self._task = None
        self._sock.close()
