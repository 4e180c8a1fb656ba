"""Starts the whole mesh on loopback as separate processes (``meshserve up``).

Order: the kvstore when asked for, the scheduler (it follows the kvstore's
placements), then the executors (they register with the scheduler), then the
gateway;
each must report SERVING on grpc.health.v1 before the next starts. ``stop``
stops them in order (``Mesh.stop_order``): the gateway first, which lets its
calls in flight finish, then the executors, then the scheduler and the kvstore;
each gets SIGTERM and is killed if it outlives its bound. Every service runs in
a process group of its own, so a Ctrl-C at the terminal reaches only ``up``.

Transport: plaintext on loopback by default (every service is started with
``--insecure``); with ``MeshConfig.tls_dir`` every service gets its role's
certificate from that directory (``meshserve certs``; made there when it holds
none) and the mesh runs mutual TLS; with ``MeshConfig.tls_files`` every service
gets the same certificate (which must then name every service role).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from meshserve.certs import has_certs, write_certs
from meshserve.cli.arglists import last_value, without
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.ports import free_port, port_is_free
from meshserve.cli.stop_order import DRAIN_GRACE_S, PARENT_ENV, stop_in_order, stop_order
from meshserve.cli.store_check import check_stores, redis_stores, stores_in_env
from meshserve.cpu_affinity import ENV as CPU_AFFINITY_ENV
from meshserve.cpu_affinity import CpuPlan, format_cpu_list, oversubscription, plan_cpus, unpinned_note, usable_cpus
from meshserve.grpc_server import LIVENESS_SERVICE, wait_serving
from meshserve.log_format import LOG_NAME_ENV
from meshserve.tls import PLAINTEXT, TLSConfig

WAIT_NOTE_S = 30.0
"""How often ``Mesh.start`` says which service it is still waiting for (``Mesh.on_progress``)."""
START_POLL_S = 0.2
"""How often a starting service is checked for having exited (seconds)."""


def default_threads_per_executor(executors: int) -> int:
    """torch CPU threads of each executor of a local mesh: the cores this process may
    use (``taskset``, a container's cpuset) less one (kept for the gateway, the
    scheduler and the clients), shared among the executors.

    On a small CPU this matters more than it seems: an OpenMP thread that loses its
    core to another process stalls every parallel region at its barrier. Measured on
    2 cores with a second process busy: one decode step of the default model took
    589 ms with 2 threads against 74 ms with 1.
    """
    return max(1, (len(usable_cpus()) - 1) // max(1, executors))


class Mesh:
    """The processes of one local mesh."""

    def __init__(self, config: MeshConfig):
        self.config = config
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.gateway_address = f"127.0.0.1:{config.port}" if config.port else ""  # port 0: set by start()
        self.scheduler_address = ""
        self.kvstore_address = ""
        self.executor_addresses: list[str] = []
        self.metrics_addresses: dict[str, str] = {}  # service name -> host:port of its /metrics
        self.http_address = ""  # host:port of the gateway's HTTP API ("" when off)
        self.executor_names: list[str] = []  # started executors, oldest first (drained ones removed)
        self.drained: set[str] = set()  # executors asked to stop (SIGTERM: they drain, then exit 0)
        self.abandoned: set[str] = set()  # executors killed for not starting in time (replaced)
        self.killed: list[str] = []  # the services the last stop() had to kill
        self._kv_args: list[str] = []
        self._num_started = 0
        self.cpu_plan: CpuPlan | None = None  # None: nothing pinned
        self.cpu_note = ""  # what the services run on when cpu_affinity asked for pinning and nothing is pinned
        self.cpu_warning = ""  # the executors' threads outnumber the cores ("": they fit)
        self._plan_cpus()
        self.cpus: dict[str, str] = {}  # service name -> the cores it is pinned to ("0-2,5"), when pinned
        self.service_env: dict[str, dict[str, str]] = {}  # service name -> its added environment
        self._executor_slots: dict[str, int] = {}  # executor name -> its slot in cpu_plan.executor_cpus
        # called every WAIT_NOTE_S of a service's start with a line naming it (``up`` prints it: a
        # first start on a busy host builds kernels and converts the model for minutes)
        self.on_progress: Callable[[str], None] | None = None
        self.clock: Callable[[], float] = time.monotonic  # seconds; tests set a fake one

    def _plan_cpus(self) -> None:
        """Sets ``cpu_warning``, and with ``cpu_affinity`` ``cpu_plan`` (or ``cpu_note``):
        a slot per executor ``autoscale`` may run, each of the executor's torch threads
        (its ``--num-threads``, which ``executor_args`` may set) times its tensor- and
        pipeline-parallel ranks, which share its cores
        (``executor.worker.distributed.cpu_shares``)."""
        c = self.config
        slots = max(c.executors, c.autoscale[1] if c.autoscale else 0, 1)
        try:
            threads = int(last_value(c.executor_args, "--num-threads") or self._threads())
            ranks = (int(last_value(c.executor_args, "--tensor-parallel-size") or 1)
                     * int(last_value(c.executor_args, "--pipeline-parallel-size") or 1))
        except ValueError:  # not a number: nothing planned; the executor's own flag check says so
            return
        cpus = usable_cpus()
        self.cpu_warning = oversubscription(cpus, slots, threads, ranks)
        if not c.cpu_affinity:
            return
        if not hasattr(os, "sched_getaffinity"):
            self.cpu_note = "not pinned (pinning needs Linux)"
            return
        self.cpu_plan = plan_cpus(cpus, slots, threads * ranks)
        if self.cpu_plan is None:
            self.cpu_note = unpinned_note(cpus, slots, threads * ranks)
            if ranks > 1:  # the launcher pins no service, but each executor still places its own ranks
                self.cpu_note += (f"; each executor still pins its {ranks - 1} child rank(s) to shares of "
                                  "its cores")

    def _threads(self) -> int:
        """The ``--num-threads`` the launcher gives each executor (``executor_args`` may
        override it)."""
        return self.config.threads_per_executor or default_threads_per_executor(self.config.executors)

    def cores_line(self) -> str:
        """What the services are pinned to (``scheduler 1, executor-0 0, gateway 1``), why
        nothing is (``cpu_note``), or "" when pinning was not asked for."""
        return ", ".join(f"{name} {cpus}" for name, cpus in self.cpus.items()) or self.cpu_note

    def tls(self, role: str = "client") -> TLSConfig:
        """The TLS settings of ``role`` in this mesh (plaintext when it runs without
        TLS); ``client`` is what a caller of the gateway (or a health probe) uses."""
        c = self.config
        if c.tls_dir is not None:
            return TLSConfig.from_dir(c.tls_dir, role)
        if c.tls_files is not None:
            return TLSConfig(*c.tls_files).checked()
        return PLAINTEXT

    def _tls_args(self, role: str) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` of ``role``, or ``--insecure``."""
        tls = self.tls(role)
        if not tls.enabled:
            return ["--insecure"]
        return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]

    def _metrics_args(self, name: str) -> list[str]:
        """``--metrics-port P`` with a free port for service ``name`` (none when metrics are off)."""
        if not self.config.metrics:
            return []
        port = free_port()
        self.metrics_addresses[name] = f"127.0.0.1:{port}"
        return ["--metrics-port", str(port)]

    def _spawn(self, name: str, args: list[str], cpus: tuple[int, ...] | None = None,
               env: dict[str, str] | None = None) -> None:
        """Starts ``meshserve ARGS`` as service ``name``, pinned to ``cpus`` when given
        (else to the services' cores of ``cpu_plan``, when there is one), with ``env``
        added to this process's environment. Without ``log_dir`` its log lines start with
        ``[name]`` (``meshserve.log_format``): every service writes to this terminal.

        Raises:
            RuntimeError: called from a thread other than the main one. Linux stops a
                service when the thread that started it ends (``stop_with_parent``).
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Mesh starts its services from the main thread only: each is stopped when the "
                               "thread that started it ends (meshserve.cli.stop_order.stop_with_parent)")
        cmd = [sys.executable, "-m", "meshserve.cli", *args]
        out = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.config.log_dir / f"{name}.log", "w")  # noqa: SIM115 - owned by the child
        self.service_env[name] = dict(env or {})
        env = dict(os.environ, **self.service_env[name], PYTHONUNBUFFERED="1")
        env.pop(LOG_NAME_ENV, None)  # a name of up's own environment is no service's
        if out is None:  # the services share up's terminal: each log line names its service
            env[LOG_NAME_ENV] = name
        env[PARENT_ENV] = str(os.getpid())  # the service stops if this process dies (stop_with_parent)
        if cpus is None and self.cpu_plan is not None:
            cpus = self.cpu_plan.service_cpus
        if cpus is not None:
            env[CPU_AFFINITY_ENV] = self.cpus[name] = format_cpu_list(cpus)
        # a process group of its own: a Ctrl-C at the terminal reaches only ``up``, which stops
        # the services in order (``stop``), not every service at once
        self.procs.append((name, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                                  process_group=0)))

    def _gateway_args(self) -> list[str]:
        """The ``meshserve gateway`` arguments, once the scheduler's address is known
        (``gateway_args`` before ``up``'s own flags, which win; an HTTP port 0 becomes a
        free port, so that ``http_address`` is known)."""
        c = self.config
        gw = ["gateway", "--port", str(c.port), "--scheduler", self.scheduler_address, "--model", c.model,
              "--result-cache-size", str(c.result_cache_size), "--task-store", c.task_store,
              *self._metrics_args("gateway"), *self._tls_args("gateway"), *c.gateway_args]
        if c.tenants_file:
            gw += ["--tenants", c.tenants_file]
        block_size = last_value(c.executor_args, "--block-size")
        if block_size is not None:  # the gateway hashes prompts in the executors' blocks
            gw += ["--block-size", block_size]
        if c.http_port is not None:
            gw += ["--http-port", str(c.http_port)]
        http_port = last_value(gw, "--http-port")
        if http_port is not None:  # the one that wins, resolved, passed once
            port = int(http_port) or free_port()
            self.http_address = f"127.0.0.1:{port}"
            gw = [*without(gw, "--http-port"), "--http-port", str(port)]
        return gw

    def command_lines(self) -> dict[str, list[str]]:
        """Service name → the ``meshserve`` arguments it was started with (the gateway's
        stores are in ``service_env``, not here)."""
        return {name: list(proc.args[3:]) for name, proc in self.procs}

    def _log_tail(self, name: str, lines: int = 5) -> str:
        """The last ``lines`` lines of service ``name``'s log, as a suffix of an error
        message ("": no ``log_dir``, the log went to the terminal)."""
        if self.config.log_dir is None:
            return ""
        path = self.config.log_dir / f"{name}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; {path} ends:\n" + "\n".join(tail) if tail else f"; {path} is empty"

    async def _wait(self, name: str, address: str, service: str = "") -> None:
        proc = dict(self.procs)[name]
        task = asyncio.create_task(wait_serving(address, self.config.startup_timeout_s, service=service,
                                                tls=self.tls("client")))
        started = self.clock()
        next_note = started + WAIT_NOTE_S
        while not task.done():
            if proc.poll() is not None:
                task.cancel()
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up{self._log_tail(name)}")
            if self.on_progress is not None and self.clock() >= next_note:
                where = f"; its log: {self.config.log_dir / f'{name}.log'}" if self.config.log_dir is not None else ""
                self.on_progress(f"still waiting for {name} to serve ({self.clock() - started:.0f} s{where})")
                next_note += WAIT_NOTE_S
            await asyncio.sleep(START_POLL_S)
        await task

    async def start(self) -> None:
        """Starts every service and waits until all are SERVING.

        Raises:
            OSError: the gateway's port is taken, or a Redis store of the gateway does not
                answer (``ConnectionError``; both checked before anything starts).
            RuntimeError: a service exited during start-up.
            TimeoutError: a service was not SERVING in time.
        """
        c = self.config
        if c.port and not port_is_free(c.port):
            raise OSError(f"port {c.port} on 127.0.0.1 is in use (another meshserve up?); choose one with --port")
        http_port = c.http_port if c.http_port is not None else last_value(c.gateway_args, "--http-port")
        if http_port and not port_is_free(int(http_port)):  # checked now, not after the model loads
            raise OSError(f"HTTP port {http_port} on 127.0.0.1 is in use (another meshserve up?); "
                          "choose one with --http-port")
        await check_stores(redis_stores(["--task-store", c.task_store, *c.gateway_args], os.environ))
        if c.tls_dir is not None and not has_certs(c.tls_dir):
            write_certs(c.tls_dir)  # raises ValueError on a directory with a CA but missing role files
        try:
            kv_args = []
            if c.kvstore_memory:
                kport = free_port()
                self.kvstore_address = f"127.0.0.1:{kport}"
                self._spawn("kvstore", ["kvstore", "--port", str(kport), "--memory", c.kvstore_memory,
                                        *self._metrics_args("kvstore"), *self._tls_args("kvstore"),
                                        *c.kvstore_args])
                await self._wait("kvstore", self.kvstore_address)
                kv_args = ["--kvstore", self.kvstore_address]
            sport = free_port()
            self.scheduler_address = f"127.0.0.1:{sport}"
            sched = ["scheduler", "--port", str(sport), *kv_args, *self._metrics_args("scheduler"),
                     *self._tls_args("scheduler"), *c.scheduler_args]
            if c.tenants_file:
                sched += ["--tenants", c.tenants_file]  # the scheduler enforces the tenants' KV quotas
            self._spawn("scheduler", sched)
            await self._wait("scheduler", self.scheduler_address)
            self._kv_args = kv_args
            for _ in range(c.executors):
                self.add_executor()
            for name, address in zip(list(self.executor_names), list(self.executor_addresses)):
                await self._wait(name, address)
            if not c.port:  # chosen now, not before the executors loaded: a port free a minute ago may not be
                c.port = free_port()
                self.gateway_address = f"127.0.0.1:{c.port}"
            args, store_env = stores_in_env(self._gateway_args(), os.environ)  # no Redis password in `ps`
            self._spawn("gateway", args, env=store_env)
            # with no executor (up --autoscale 0..N: scale to zero) the gateway is alive, not ready
            await self._wait("gateway", self.gateway_address, "" if c.executors else LIVENESS_SERVICE)
        except BaseException:
            self.stop()
            raise

    def add_executor(self) -> tuple[str, str]:
        """Starts one more executor process (``executor-N``, N counting every one started);
        returns its name and address. It registers with the scheduler once loaded."""
        c = self.config
        name, eport = f"executor-{self._num_started}", free_port()
        self._num_started += 1
        threads = self._threads()
        self.executor_names.append(name)
        self.executor_addresses.append(f"127.0.0.1:{eport}")
        self._spawn(name, ["executor", "--port", str(eport), "--scheduler", self.scheduler_address,
                           "--model", c.model, "--executor-id", name, "--num-threads", str(threads),
                           *self._kv_args, *self._metrics_args(name), *self._tls_args("executor"),
                           *c.executor_args], self._executor_cpus(name))
        return name, self.executor_addresses[-1]

    def _executor_cpus(self, name: str) -> tuple[int, ...] | None:
        """The cores of the lowest slot of ``cpu_plan`` no running executor holds (a
        draining one keeps its slot until it exits); every core of the launcher when
        all slots are held; None without a plan."""
        if self.cpu_plan is None:
            return None
        procs = dict(self.procs)
        held = {slot for other, slot in self._executor_slots.items()
                if other not in procs or procs[other].poll() is None}
        free = [i for i in range(len(self.cpu_plan.executor_cpus)) if i not in held]
        if not free:
            return tuple(usable_cpus())
        self._executor_slots[name] = free[0]
        return self.cpu_plan.executor_cpus[free[0]]

    def drain_executor(self, name: str) -> None:
        """SIGTERM to one executor: it drains (``executor.drain``) and exits on its own."""
        i = self.executor_names.index(name)
        del self.executor_names[i], self.executor_addresses[i]
        self.drained.add(name)
        dict(self.procs)[name].send_signal(signal.SIGTERM)

    def abandon_executor(self, name: str) -> None:
        """SIGKILL to an executor that did not start in time (it serves nothing yet);
        its exit is not a failure of the mesh (``exited``)."""
        i = self.executor_names.index(name)
        del self.executor_names[i], self.executor_addresses[i]
        self.abandoned.add(name)
        dict(self.procs)[name].kill()

    def gateway_drain_grace_s(self) -> float:
        """The gateway's ``--drain-grace-s`` (seconds its calls in flight get at a stop)."""
        return float(last_value(self.config.gateway_args, "--drain-grace-s") or DRAIN_GRACE_S)

    def stop_order(self) -> list[tuple[list[str], float]]:
        """The services, tier by tier, with each tier's bound (``meshserve.cli.stop_order``)."""
        executor_grace = float(last_value(self.config.executor_args, "--drain-grace-s") or DRAIN_GRACE_S)
        return stop_order([name for name, _ in self.procs], self.gateway_drain_grace_s(), executor_grace)

    def stop(self) -> list[str]:
        """Stops every service in ``stop_order`` (``stop_in_order``: SIGTERM, SIGKILL
        past a tier's bound); returns the services that had to be killed. A second
        Ctrl-C while it waits kills every service (and raises KeyboardInterrupt). The
        killed services are also kept in ``killed`` (a stop by ``start``, which
        stops what it started when it fails or is cancelled, returns nothing)."""
        try:
            self.killed = stop_in_order(dict(self.procs), self.stop_order())
            return self.killed
        finally:
            self.procs.clear()

    def kill(self) -> None:
        """SIGKILL to every service still running, in ``stop_order``, waiting for none
        (a Ctrl-C while stopping, from its signal handler; ``stop`` reaps them)."""
        procs = dict(self.procs)
        for tier, _ in self.stop_order():
            for name in tier:
                procs[name].kill()  # a no-op for one already reaped

    def is_running(self, name: str) -> bool:
        """Whether service ``name`` was started and has not exited."""
        proc = dict(self.procs).get(name)
        return proc is not None and proc.poll() is None

    def exit_code(self, name: str) -> int | None:
        """A service's exit code, or None while it runs."""
        return dict(self.procs)[name].poll()

    def exited(self) -> list[str]:
        """Names of services that have exited, less drained executors that exited cleanly (0)
        and abandoned ones (killed for not starting in time)."""
        return [name for name, proc in self.procs
                if proc.poll() is not None and not (name in self.drained and proc.returncode == 0)
                and name not in self.abandoned]
