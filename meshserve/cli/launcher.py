"""Starts the whole mesh on loopback as separate processes (``meshserve up``).

Order: the kvstore when asked for, the scheduler (it follows the kvstore's
placements), then the executors (they register with the scheduler), then the
gateway;
each must report SERVING on grpc.health.v1 before the next starts. ``stop``
sends SIGTERM to all (gateway first) and kills what is still alive after the
grace period.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshserve.grpc_server import wait_serving


def default_threads_per_executor(executors: int) -> int:
    """torch CPU threads of each executor of a local mesh: the cores less one (kept for
    the gateway, the scheduler and the clients), shared among the executors.

    On a small CPU this matters more than it seems: an OpenMP thread that loses its
    core to another process stalls every parallel region at its barrier. Measured on
    2 cores with a second process busy: one decode step of the default model took
    589 ms with 2 threads against 74 ms with 1.
    """
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, executors))


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a TCP listener could bind ``host:port`` now."""
    with socket.socket() as s:
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


@dataclass
class MeshConfig:
    """What ``meshserve up`` starts.

    Attributes:
        port: the gateway's public port.
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
        gateway_args: extra ``meshserve gateway`` flags (``--result-cache``…).
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
    gateway_args: list[str] = field(default_factory=list)


class Mesh:
    """The processes of one local mesh."""

    def __init__(self, config: MeshConfig):
        self.config = config
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.gateway_address = f"127.0.0.1:{config.port}"
        self.scheduler_address = ""
        self.kvstore_address = ""
        self.executor_addresses: list[str] = []
        self.metrics_addresses: dict[str, str] = {}  # service name -> host:port of its /metrics

    def _metrics_args(self, name: str) -> list[str]:
        """``--metrics-port P`` with a free port for service ``name`` (none when metrics are off)."""
        if not self.config.metrics:
            return []
        port = free_port()
        self.metrics_addresses[name] = f"127.0.0.1:{port}"
        return ["--metrics-port", str(port)]

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "meshserve.cli", *args]
        out = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.config.log_dir / f"{name}.log", "w")  # noqa: SIM115 - owned by the child
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs.append((name, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)))

    def _gateway_args(self) -> list[str]:
        """The ``meshserve gateway`` arguments, once the scheduler's address is known."""
        c = self.config
        gw = ["gateway", "--port", str(c.port), "--scheduler", self.scheduler_address, "--model", c.model,
              "--result-cache-size", str(c.result_cache_size), "--task-store", c.task_store,
              *self._metrics_args("gateway"), *c.gateway_args]
        if c.tenants_file:
            gw += ["--tenants", c.tenants_file]
        if "--block-size" in c.executor_args:  # the gateway hashes prompts in the executors' blocks
            gw += ["--block-size", c.executor_args[c.executor_args.index("--block-size") + 1]]
        return gw

    async def _wait(self, name: str, address: str) -> None:
        proc = dict(self.procs)[name]
        task = asyncio.create_task(wait_serving(address, self.config.startup_timeout_s))
        while not task.done():
            if proc.poll() is not None:
                task.cancel()
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")
            await asyncio.sleep(0.2)
        await task

    async def start(self) -> None:
        """Starts every service and waits until all are SERVING.

        Raises:
            OSError: the gateway's port is taken (checked before anything starts).
            RuntimeError: a service exited during start-up.
            TimeoutError: a service was not SERVING in time.
        """
        c = self.config
        if c.port and not port_is_free(c.port):
            raise OSError(f"port {c.port} on 127.0.0.1 is in use (another meshserve up?); choose one with --port")
        try:
            kv_args = []
            if c.kvstore_memory:
                kport = free_port()
                self.kvstore_address = f"127.0.0.1:{kport}"
                self._spawn("kvstore", ["kvstore", "--port", str(kport), "--memory", c.kvstore_memory,
                                        *self._metrics_args("kvstore")])
                await self._wait("kvstore", self.kvstore_address)
                kv_args = ["--kvstore", self.kvstore_address]
            sport = free_port()
            self.scheduler_address = f"127.0.0.1:{sport}"
            sched = ["scheduler", "--port", str(sport), *kv_args, *self._metrics_args("scheduler"), *c.scheduler_args]
            if c.tenants_file:
                sched += ["--tenants", c.tenants_file]  # the scheduler enforces the tenants' KV quotas
            self._spawn("scheduler", sched)
            await self._wait("scheduler", self.scheduler_address)
            threads = c.threads_per_executor or default_threads_per_executor(c.executors)
            for i in range(c.executors):
                eport = free_port()
                self.executor_addresses.append(f"127.0.0.1:{eport}")
                self._spawn(f"executor-{i}", ["executor", "--port", str(eport), "--scheduler", self.scheduler_address,
                                              "--model", c.model, "--executor-id", f"executor-{i}",
                                              "--num-threads", str(threads), *kv_args,
                                              *self._metrics_args(f"executor-{i}"), *c.executor_args])
            for i, address in enumerate(self.executor_addresses):
                await self._wait(f"executor-{i}", address)
            self._spawn("gateway", self._gateway_args())
            await self._wait("gateway", self.gateway_address)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every service (gateway first), SIGKILL after ``grace_s``."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def exited(self) -> list[str]:
        """Names of services that have exited."""
        return [name for name, proc in self.procs if proc.poll() is not None]
