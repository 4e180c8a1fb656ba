"""``MeshConfig``: what ``meshserve up`` starts, as plain settings.

``meshserve.cli.launcher.Mesh`` starts the processes one describes (the default
of ``threads_per_executor``, ``default_threads_per_executor``, and the CPU plan of
``cpu_affinity`` are the launcher's); ``meshserve.cli.mesh.mesh_config`` makes one
from ``up``'s flags, and the demo and the benchmarks make their own. A
``MeshConfig`` starts nothing and checks nothing: each service checks its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class MeshConfig:
    """What ``meshserve up`` starts.

    Attributes:
        port: the gateway's public port (0: a free port, chosen just before the gateway
            starts, so that nothing else takes it while the executors load).
        executors: number of executor processes.
        model: model alias or path (see ``meshserve.model_files``).
        executor_args: extra ``meshserve executor`` flags (dtype, KV memory…).
        threads_per_executor: torch threads of each executor (default:
            ``default_threads_per_executor``).
        log_dir: where each service's log goes (None: inherit the terminal).
        tenants_file: tenants TOML, passed to the gateway (keys, priorities)
            and to the scheduler (KV quotas).
        scheduler_args: extra ``meshserve scheduler`` flags (queue policy…).
        kvstore_memory: start one kvstore (memory tier budget, e.g. ``1GiB``) and pass
            ``--kvstore`` to every executor; None: no kvstore.
        metrics: give every service a free port for its Prometheus ``/metrics``
            (``Mesh.metrics_addresses``).
        result_cache_size: the gateway's ``--result-cache-size`` (entries; 0: off).
        task_store: the gateway's ``--task-store``: ``memory`` or a ``redis://host:port/db`` URL.
        tls_dir: run the mesh over mutual TLS with the role certificates of this
            directory (``meshserve certs``; made at start when it holds none).
        tls_files: ``(cert, key, ca)``: mutual TLS with one certificate for every
            service (it must name the roles gateway, scheduler, executor and kvstore).
            Neither: plaintext on loopback.
        http_port: the gateway's ``--http-port`` (its OpenAI-compatible HTTP API; 0: a free
            port; None: no HTTP).
        gateway_args / kvstore_args: extra ``meshserve gateway`` / ``kvstore`` flags.
        autoscale: ``(min, max)`` executors for ``meshserve up --autoscale`` (run by
            ``meshserve.cli.autoscale.LocalAutoscaler``), or None: a fixed count.
        start_budget_s: with ``autoscale``, how long an executor may take to be ready
            before it is failed and replaced (None: ``startup_timeout_s``); the
            scheduler, gateway and kvstore keep ``startup_timeout_s``.
        cpu_affinity: pin each executor to cores of its own (its threads times its
            tensor- and pipeline-parallel ranks) and the other services to the cores
            left (``meshserve.cpu_affinity``), when the launcher's cores fit every
            executor (``autoscale``'s maximum) plus one; otherwise nothing is pinned.
    """

    port: int = 50051
    executors: int = 1
    model: str = "default"
    executor_args: list[str] = field(default_factory=list)
    threads_per_executor: int | None = None
    log_dir: Path | None = None
    tenants_file: str | None = None
    scheduler_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0
    kvstore_memory: str | None = None  # start one kvstore with this memory budget (None: no kvstore)
    metrics: bool = False
    result_cache_size: int = 0
    task_store: str = "memory"
    tls_dir: Path | None = None
    tls_files: tuple[str, str, str] | None = None
    http_port: int | None = None
    autoscale: tuple[int, int] | None = None
    start_budget_s: float | None = None
    gateway_args: list[str] = field(default_factory=list)
    kvstore_args: list[str] = field(default_factory=list)
    cpu_affinity: bool = False
