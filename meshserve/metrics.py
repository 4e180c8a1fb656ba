"""Prometheus metrics shared by every service: one registry per service, bounded
label values, common bucket layouts, and the ``/metrics`` HTTP endpoint.

Each service owns its own ``CollectorRegistry`` (never the process-global
default), so the four services can run in one process (the test mesh) without
their metrics colliding, and each serves it on its own port::

    registry = new_registry("gateway")           # + process_* metrics of this process
    ttft = Histogram(..., registry=registry)
    server = MetricsServer(registry, port=9400)  # GET http://host:9400/metrics
    ...
    server.stop()

Every metric name starts with ``meshserve_`` (units in the name: ``_seconds``,
``_bytes``, ``_tokens``, ``_ratio`` in [0, 1]); counters end in ``_total`` on
the wire. Per-tenant labels are bounded by ``BoundedLabel``: a runaway set of
tenant names cannot blow up the time-series count.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Iterable, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Info, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

# Request latencies (seconds): TTFT, end-to-end, queue time. Covers a fast GPU's 10 ms
# first token up to a CPU's minutes-long queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0)
# Inter-token latency (seconds per output token).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# Short internal calls (kvstore transfers).
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

T = TypeVar("T")

DEFAULT_MAX_TENANT_LABELS = 32
DEFAULT_MAX_PRIORITY_LABELS = 16
OTHER = "other"


class BoundedLabel:
    """Maps label values to at most ``max_values`` distinct ones: the first
    ``max_values`` values seen keep their name, every later new value becomes
    ``"other"``. Values ``reserve``d (the configured ones) always keep their name,
    beside the ``max_values`` first seen, so callers' junk values cannot push them
    into ``"other"``. Thread-safe.

    Args:
        max_values: distinct values kept (>= 0; 0 folds everything into "other").

    Raises:
        ValueError: ``max_values`` < 0.
    """

    def __init__(self, max_values: int):
        if max_values < 0:
            raise ValueError(f"max_values must be >= 0, got {max_values}")
        self.max_values = max_values
        self._kept: set[str] = set()
        self._reserved: set[str] = set()
        self._lock = threading.Lock()

    def reserve(self, values: Iterable[object]) -> None:
        """``values`` keep their own label whenever they come, outside the count."""
        with self._lock:
            self._reserved.update(str(v) for v in values if str(v) != OTHER)

    def __call__(self, value: object) -> str:
        """The label value to use for ``value`` (its ``str``, or ``"other"``)."""
        text = str(value)
        with self._lock:
            if text in self._kept or text in self._reserved:
                return text
            if len(self._kept) < self.max_values and text != OTHER:
                self._kept.add(text)
                return text
        return OTHER

    @property
    def kept(self) -> frozenset[str]:
        """The values that keep their own label."""
        with self._lock:
            return frozenset(self._kept | self._reserved)


def snapshot(read: Callable[[], T], attempts: int = 5) -> T:
    """``read()``, taken again when it raced the event loop: a scrape runs in the
    HTTP server's thread while the service's loop changes dicts that ``read``
    iterates ("dictionary changed size during iteration")."""
    for _ in range(attempts - 1):
        try:
            return read()
        except RuntimeError:
            continue
    return read()


def new_registry(service: str) -> CollectorRegistry:
    """A fresh registry for one service with ``meshserve_build_info{service=...}``
    and the process's ``process_*`` metrics (CPU seconds, resident memory, open
    files; Linux only)."""
    from importlib.metadata import PackageNotFoundError, version

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    try:
        ver = version("meshserve")
    except PackageNotFoundError:  # running from a source tree that is not installed
        ver = "unknown"
    Info("meshserve_build", "meshserve version and the service of this endpoint.",
         registry=registry).info({"service": service, "version": ver})
    return registry


STOP_POLL_S = 0.05  # how often the endpoint's thread looks for a stop: the most ``MetricsServer.stop`` waits


class _QuietHandler(WSGIRequestHandler):
    """No log line per scrape."""

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class MetricsServer:
    """Serves a registry at ``http://host:port/metrics`` from a daemon thread
    (prometheus-client's WSGI app and threading server, as its ``start_http_server``
    serves them, but looking for a stop every ``STOP_POLL_S`` seconds instead of
    every 0.5 s: a service's stop waited up to that long for its metrics endpoint).

    Args:
        registry: what to serve.
        port: TCP port; 0 picks a free one (see ``port``).
        host: interface to listen on.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1"):
        self.registry = registry
        try:
            self._server = _bind(registry, port, host)
        except OSError as exc:
            raise OSError(f"metrics: cannot listen on {host}:{port} (port in use or not allowed); "
                          "choose one with --metrics-port") from exc
        self._thread: threading.Thread | None = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": STOP_POLL_S}, name="metrics-http",
            daemon=True)
        self._thread.start()
        self.host = host
        self.port = self._server.server_port
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"  # an IPv6 host in brackets
        log.info("metrics on http://%s/metrics", self.address)

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        """Stops listening and joins the server thread (idempotent)."""
        if self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._thread = None


def _bind(registry: CollectorRegistry, port: int, host: str) -> ThreadingWSGIServer:
    """A threading WSGI server of ``registry``'s exposition bound to ``host:port``
    (an IPv6 host gets an IPv6 socket).

    Raises:
        OSError: the port cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsHTTPServer", (ThreadingWSGIServer,), {"address_family": family})
    return make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)


def priority_classes(defaults: Iterable[int], ceilings: Iterable[int | None], most: int = DEFAULT_MAX_PRIORITY_LABELS
                     ) -> list[int]:
    """The priority classes a mesh is configured for, to ``BoundedLabel.reserve``: every
    integer from the lowest default priority (0 at least) to the highest ceiling, when
    that span holds at most ``most`` values; else the configured values alone.

    Args:
        defaults: the tenants' ``default_priority`` values.
        ceilings: their ``max_priority`` values (None: no ceiling).
    """
    values = {0, *defaults, *(c for c in ceilings if c is not None)}
    low, high = min(values), max(values)
    return list(range(low, high + 1)) if high - low < most else sorted(values)
