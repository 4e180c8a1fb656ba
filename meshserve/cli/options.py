"""What the ``meshserve`` sub-commands share: common options, start-up helpers and flag parsers.

An option object here is the default of a parameter in several commands, so
that its flag, default and help text are the same wherever it appears
(``--result-cache-size`` and ``--task-store`` on ``gateway`` and ``up``, the
tracing, metrics and health-port options on every service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from typing import Coroutine, Optional

import typer

from meshserve.log_format import log_format

TracesOpt = typer.Option(None, "--traces",
                         help="Trace exporter: none, console, otlp (default: $MESHSERVE_TRACES or none).")
OtlpOpt = typer.Option(None, "--otlp-endpoint", help="OTLP/gRPC collector host:port (default localhost:4317).")
SampleOpt = typer.Option(None, "--trace-sample-ratio", min=0.0, max=1.0,
                         help="Fraction of new traces kept, ParentBased(TraceIdRatioBased) "
                              "(default: $MESHSERVE_TRACE_SAMPLE_RATIO or 1).")
MetricsPortOpt = typer.Option(None, "--metrics-port", min=0, max=65535,
                              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged; "
                                   "default: off).")
HealthPortOpt = typer.Option(None, "--health-port", min=0, max=65535,
                             help="Also serve grpc.health.v1 alone, in plaintext, on this port (for probes that "
                                  "cannot speak mutual TLS, e.g. Kubernetes' gRPC probes; default: off).")
ResultCacheSizeOpt = typer.Option(0, "--result-cache-size", min=0, help="Entries of the result cache of "
                                  "deterministic requests (greedy or seeded), LRU; 0: off.")
HttpPortOpt = typer.Option(None, "--http-port", min=0, max=65535,
                           help="Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                "/v1/models, /v1/tasks, /health, /ready, /version; /metrics only without "
                                "--tenants) on this port (0: a free one; default: off).")
ServedModelNameOpt = typer.Option(None, "--served-model-name",
                                  help="Name(s) callers pass as `model` (repeat for several; a response carries "
                                       "the name its request sent, the first when it sent none; default: the "
                                       "model's id).")
RevisionOpt = typer.Option(None, "--revision", help="Revision (branch, tag or commit) of a Hugging Face model id, "
                           "read from the local Hugging Face cache (default: main).")
TokenizerOpt = typer.Option(None, "--tokenizer", help="Tokenizer folder or Hugging Face id (default: the model's).")
ChatTemplateOpt = typer.Option(None, "--chat-template", help="Jinja chat template: a file, or the template "
                               "itself (default: the tokenizer's).")
TaskStoreOpt = typer.Option("memory", "--task-store", envvar="MESHSERVE_TASK_STORE",
                            help="Async task store: memory, or redis://host:port/db (shared by gateways); a "
                                 "URL with a password belongs in the variable (a command line shows in ps).")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parses a byte size such as ``1073741824``, ``512MiB`` or ``2GB`` (the value of
    ``--kv-cache-memory``, ``--memory``, ``--disk``…).

    Raises:
        ValueError: not a size.
    """
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def setup_logging(level: str) -> None:
    """Logs of ``level`` (``info``, ``warning``…, any case) and above go to stderr, one line
    each, led by the service's name in a local mesh (``meshserve.log_format``)."""
    logging.basicConfig(level=level.upper(), format=log_format(), stream=sys.stderr)


def show_model_conversion() -> None:
    """Prints the one-time GGUF conversion's log lines (``meshserve.model_files``) on
    stderr, for the commands that resolve the model in their own process without
    configuring logging (``up``, ``demo``): the first start is then not silent."""
    logger = logging.getLogger("meshserve.model_files")
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when it writes (not the stream
    of the moment it was made: a command run in-process, as by a test runner, may
    have replaced and closed that one since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def export_trace_settings(exporter: Optional[str], endpoint: Optional[str],
                          sample_ratio: Optional[float] = None) -> None:
    """Puts the tracing flags that were given into the environment, where telemetry set-up
    reads them (``MESHSERVE_TRACES``, ``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``MESHSERVE_TRACE_SAMPLE_RATIO``); ``up`` thereby hands them to every service process."""
    if exporter:
        os.environ["MESHSERVE_TRACES"] = exporter
    if endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    if sample_ratio is not None:
        os.environ["MESHSERVE_TRACE_SAMPLE_RATIO"] = repr(sample_ratio)


def serve(coro: Coroutine) -> None:
    """Runs a service's coroutine; a start-up failure the operator can fix (bad
    model path or flag value, busy port, unreachable scheduler) is one line on
    stderr and exit code 1, not a traceback. Anything else is our bug and keeps
    its traceback.

    Raises:
        typer.Exit: code 1 on ``ValueError``, ``OSError`` or ``TimeoutError``.
    """
    from meshserve.cli.stop_order import stop_with_parent

    stop_with_parent()  # started by meshserve up: stop if up dies without stopping us
    try:
        asyncio.run(coro)
    except (ValueError, OSError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def is_address(text: str) -> bool:
    """True when ``text`` is ``HOST:PORT`` with a non-empty host and a port in 1..65535."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


TLSCertOpt = typer.Option(None, "--tls-cert", help="This process's certificate (PEM; its role in a "
                          "spiffe://meshserve/<role> URI SAN: see `meshserve certs`).")
TLSKeyOpt = typer.Option(None, "--tls-key", help="The certificate's private key (PEM).")
TLSCAOpt = typer.Option(None, "--tls-ca", help="CA certificate(s) that peers' certificates must chain to (PEM).")
InsecureOpt = typer.Option(False, "--insecure", help="Plaintext, no certificates and no role checks (local "
                           "development only).")


def tls_settings(cert: Optional[str], key: Optional[str], ca: Optional[str], insecure: bool, client: bool = False):
    """The ``meshserve.tls.TLSConfig`` of a command's TLS flags. A service needs
    ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (mutual TLS) or ``--insecure``;
    a client (``client``) speaks plaintext with no flag and TLS with ``--tls-ca``.

    Raises:
        typer.Exit: code 2 (a usage error) after one line on stderr naming the
            flag: a missing or conflicting flag, an unreadable file.
    """
    from meshserve.tls import TLSConfig  # grpc: only when a command runs

    try:
        return TLSConfig.from_flags(cert, key, ca, insecure, client=client)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

# The autoscaling planner's settings: `meshserve scheduler` takes them, and `meshserve up
# --autoscale` passes them on to its scheduler.
PlannerIntervalOpt = typer.Option(60.0, "--planner-interval-s", help="Autoscaling planner: one load sample and "
                                  "one decision per interval (seconds).")
PlannerSeasonOpt = typer.Option(86400.0, "--planner-season-s", help="Planner: the load's season (a day), a "
                                "multiple of the interval (seconds).")
ExecutorCapacityOpt = typer.Option(2000.0, "--executor-capacity-tokens-per-s", help="Planner: one executor's "
                                   "capacity until measured (tokens/s).")
ScaleDownCooldownOpt = typer.Option(300.0, "--scale-down-cooldown-s", help="Planner: load below the count this "
                                    "long before one executor less (seconds).")
StartBudgetOpt = typer.Option(None, "--start-budget-s", help="Scale to zero: a request that finds no executor "
                              "of its model waits this long for one to start and register, then UNAVAILABLE "
                              "(seconds; default: UNAVAILABLE at once).")
