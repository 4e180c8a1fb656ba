"""What every service's gRPC server shares: the error interceptor, grpc.health.v1,
binding, and a clean stop on SIGINT/SIGTERM with a grace period; and the one
place where servers' ports and channels get their credentials (``Service`` and
``open_channel``, from a ``meshserve.tls.TLSConfig``)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshserve.authz import GuardInterceptor
from meshserve.errors import ErrorInterceptor
from meshserve.health_servicer import DrainingHealthServicer
from meshserve.roles import ROLE_TABLE
from meshserve.tls import PLAINTEXT, TLSConfig

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The scheduler's health answers for this name: SERVING while an executor is
# registered. The gateway is ready (SERVING) only while it is.
EXECUTORS_HEALTH_SERVICE = "meshserve.v1.Executor"
# Liveness: SERVING from the moment a service listens until it stops, whatever its
# readiness ("" and its own name: NOT_SERVING while it cannot serve, e.g. a gateway with
# no executor). Kubernetes' liveness probes name it; readiness probes use "".
LIVENESS_SERVICE = "meshserve.liveness"

# Long token streams and the executors' long-lived Connect streams: clients ping
# every 20 s, and servers must accept that (gRPC's server default allows one ping
# per 5 minutes and answers more with GOAWAY "too_many_pings", which would drop
# every idle executor from the registry after about 80 s).
_MESSAGE_LIMITS = (
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
)
CHANNEL_OPTIONS = _MESSAGE_LIMITS + (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)
# The gateway's channels to executors carry token streams: a fixed 8 KiB stream
# window (no BDP probing, which grows it to MBs on loopback) keeps what a stalled
# client backs up in flight small (~80 token messages), so the executor's own bound
# (``AsyncEngine.max_buffered_outputs``) is reached. Token streams need a few KB/s.
TOKEN_STREAM_CHANNEL_OPTIONS = CHANNEL_OPTIONS + (
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 8192),
)
SERVER_OPTIONS = _MESSAGE_LIMITS + (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


class Service:
    """A grpc.aio server with the error interceptor, the guard (roles, malformed
    requests: ``meshserve.authz``) and a health servicer.

    ``health`` starts NOT_SERVING for both the overall status ("") and ``name``;
    the service sets SERVING once warm. ``background`` holds tasks with an async
    ``stop()`` (``meshserve.background.BackgroundTask``) that ``stop`` ends first.

    With ``tls`` enabled the port serves TLS with ``tls``'s certificate and checks
    every caller's role (``meshserve.roles``); callers must present a certificate
    from ``tls.ca`` (mutual TLS) unless ``public`` (the gateway's port: a client
    certificate is optional there, the API key authenticates).
    Server reflection (grpc.reflection.v1alpha, ``grpcurl list``) names ``name``,
    health and reflection itself; a service with more servicers adds their full
    names to ``reflected`` before ``start``.

    With ``health_port`` (None: none; 0: a free one, ``health_address``) a second,
    plaintext server on ``host`` serves only grpc.health.v1 from the same
    servicer (the same statuses): for probes that cannot speak mutual TLS, such as
    Kubernetes' native gRPC probes. Every other method there is UNIMPLEMENTED, and
    it has no reflection.
    """

    def __init__(self, name: str, port: int, host: str = "127.0.0.1", tls: TLSConfig = PLAINTEXT,
                 public: bool = False, health_port: int | None = None):
        self.name = name
        self.tls = tls
        guard = GuardInterceptor(ROLE_TABLE if tls.enabled else None)
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor(), guard], options=SERVER_OPTIONS)
        self.health = DrainingHealthServicer()  # its Watch streams end at a stop: they never hold the drain
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            if tls.enabled:
                creds = tls.server_credentials(require_client_auth=not public)
                self.port = self.server.add_secure_port(f"{host}:{port}", creds)
            else:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpc's "Failed to bind to address …"
            self.port = 0
        if self.port == 0:
            raise OSError(f"{name}: cannot listen on {host}:{port} (port in use or not allowed); "
                          "choose one with --port")
        self.address = f"{host}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        self.health_address: str | None = None
        if health_port is not None:
            self._add_health_server(host, health_port)
        self.background: list = []  # BackgroundTasks, stopped first by stop()
        self.drained_alongside: list = []  # async stop(grace_s) of servers that drain with the gRPC one
        self.host = host
        self.metrics = None  # a meshserve.metrics.MetricsServer once serve_metrics ran
        self.started = False  # start() ran
        self.reflected: list[str] = [name]

    def _add_health_server(self, host: str, port: int) -> None:
        """Binds the plaintext health-only server (``health_port`` above).

        Raises:
            OSError: the port cannot be bound.
        """
        self.health_server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        try:
            bound = self.health_server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpc's "Failed to bind to address …"
            bound = 0
        if bound == 0:
            raise OSError(f"{self.name}: cannot listen on {host}:{port} for health (port in use or not allowed); "
                          "choose one with --health-port")
        self.health_address = f"{host}:{bound}"

    def serve_metrics(self, registry, port: int | None) -> None:
        """Serves ``registry`` (Prometheus) at ``http://host:port/metrics`` until ``stop``;
        None: no endpoint, 0: a free port (``metrics.port``).

        Raises:
            OSError: the port cannot be bound.
        """
        if port is not None:
            from meshserve.metrics import MetricsServer

            self.metrics = MetricsServer(registry, port, self.host)

    async def start(self) -> None:
        """Starts listening (health still NOT_SERVING, liveness SERVING), with server reflection."""
        reflection.enable_server_reflection(
            (*self.reflected, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        await self.health.set("", NOT_SERVING)
        await self.health.set(self.name, NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        self.started = True
        await self.health.set(LIVENESS_SERVICE, SERVING)

    async def set_serving(self, serving: bool = True) -> None:
        """Reports SERVING or NOT_SERVING on grpc.health.v1."""
        status = SERVING if serving else NOT_SERVING
        await self.health.set("", status)
        await self.health.set(self.name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops the background tasks, reports NOT_SERVING, then stops, letting calls
        finish for ``grace_s`` seconds; the ``drained_alongside`` servers (the gateway's
        HTTP) stop at the same time, with the same grace."""
        for task in self.background:
            await task.stop()
        if not self.started:  # gRPC frees a bound server's ports only once it was started
            await self.server.start()
            if self.health_server is not None:
                await self.health_server.start()
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace_s), *(stop(grace_s) for stop in self.drained_alongside))
        if self.health_server is not None:
            await self.health_server.stop(grace_s)
        if self.metrics is not None:
            self.metrics.stop()


async def run_until_signal(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]],
                           done: asyncio.Event | None = None) -> None:
    """Runs ``start``, waits for SIGINT/SIGTERM (or ``done`` set by the service
    itself, e.g. on a fatal error), then runs ``stop``."""
    done = done or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await start()
    await done.wait()
    await stop()


def open_channel(address: str, tls: TLSConfig = PLAINTEXT, options=CHANNEL_OPTIONS,
                 server_name: str | None = None) -> grpc.aio.Channel:
    """A channel to ``address`` (host:port): TLS with ``tls``'s CA and client
    certificate, or plaintext with ``PLAINTEXT``. The server certificate's SANs must
    name ``server_name`` when given (gRPC's ``grpc.ssl_target_name_override``), else
    the host dialled."""
    if tls.enabled:
        if server_name:
            options = (*options, ("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


# Reconnect backoff of wait_serving's channel: gRPC's default grows to 120 s, so a port
# closed for 30 s (an executor loading its model) was seen SERVING ~12 s late (measured).
WAIT_RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                          ("grpc.max_reconnect_backoff_ms", 1000))


async def wait_serving(address: str, timeout_s: float = 120.0, service: str = "",
                       tls: TLSConfig = PLAINTEXT) -> None:
    """Polls grpc.health.v1 at ``address`` (over ``tls``) until SERVING.

    Raises:
        TimeoutError: not SERVING within ``timeout_s`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with open_channel(address, tls, CHANNEL_OPTIONS + WAIT_RECONNECT_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
