"""An in-process mesh for tests: scheduler, executors and gateway in one event loop,
talking real gRPC over loopback ports, over mutual TLS by default (each service
with its role's certificate from ``tests.support.tls``)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from executor.engine.async_engine import AsyncEngine
from executor.engine.llm_engine import LLMEngine
from executor.scheduler_link import SchedulerLink
from executor.server import start_executor
from gateway.request import ModelInfo
from gateway.server import start_gateway
from meshserve.client import channel
from meshserve.grpc_server import Service
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2_grpc
from scheduler.server import start_scheduler
from tests.support.tls import role_tls


# A mesh shared by several test files (a session or package fixture) runs its event
# loop only while an async test runs. Under xdist, other files' synchronous tests (an
# engine's golden run: minutes) run on the same worker between two files that use it;
# when the loop resumes, the scheduler's silence timer has long expired before the
# executor's heartbeat can be read, and it dropped the executor as unreachable
# (UNAVAILABLE for the next test's request). Such a mesh's scheduler so waits an hour
# for a silent executor; the drop itself is tested on meshes of their own
# (tests/mesh/test_robustness.py, C24).
SHARED_MESH_EXECUTOR_TIMEOUT_S = 3600.0


@dataclass
class LocalMesh:
    """Handles on every part of an in-process mesh."""

    scheduler: Service
    gateway: Service
    executors: list[tuple[Service, AsyncEngine, SchedulerLink]] = field(default_factory=list)
    kvstore: Service | None = None
    stub: gateway_pb2_grpc.GatewayStub | None = None
    _channel: object = None
    secure: bool = True

    def tls(self, role: str = "client") -> TLSConfig:
        """The TLS settings a caller of this mesh in ``role`` uses (plaintext when
        the mesh runs without TLS)."""
        return role_tls(role) if self.secure else PLAINTEXT

    def metrics_urls(self) -> dict[str, str]:
        """Service name → its /metrics URL, for the services serving metrics."""
        services = [("gateway", self.gateway), ("scheduler", self.scheduler), ("kvstore", self.kvstore)]
        services += [(f"executor-{i}", svc) for i, (svc, _, _) in enumerate(self.executors)]
        return {name: svc.metrics.url for name, svc in services if svc is not None and svc.metrics is not None}

    @property
    def http_url(self) -> str:
        """The gateway's HTTP base URL (``http://127.0.0.1:PORT``; the mesh started with ``http``)."""
        return self.gateway.http.url

    @property
    def engines(self) -> list[LLMEngine]:
        return [e.engine for _, e, _ in self.executors]

    async def executor_stats(self, i: int = 0) -> executor_pb2.StatsResponse:
        """Stats of executor ``i`` over its gRPC Stats call."""
        async with channel(self.executors[i][0].address, self.tls("client")) as ch:
            return await executor_pb2_grpc.ExecutorStub(ch).Stats(executor_pb2.StatsRequest())

    async def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Waits until every engine has no request and every block is free.

        Raises:
            TimeoutError: blocks still held after ``timeout_s`` (a hang bound).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            stats = [e.stats() for _, e, _ in self.executors]
            if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks for s in stats):
                return
            if loop.time() > deadline:
                raise TimeoutError(f"engines not idle: {stats}")
            await asyncio.sleep(0.02)

    async def wait_released(self, timeout_s: float = 120.0) -> None:
        """``wait_idle``, then waits until the scheduler holds no lease and queues no
        request: a cancelled call's Release is sent by the gateway just after the engine
        frees the blocks, so it can land after the engines look idle.

        Raises:
            TimeoutError: blocks or leases still held after ``timeout_s`` (a hang bound).
        """
        await self.wait_idle(timeout_s)
        core = self.scheduler.servicer.core
        await wait_for_condition(lambda: core.num_leases() == 0 and len(core) == 0, timeout_s,
                                 "every lease released")

    async def stop(self) -> None:
        await self._channel.close()
        await self.gateway.stop(0.5)
        await self.gateway.servicer.close()
        for svc, eng, link in self.executors:
            await svc.watchdog.stop()
            await svc.stop(0.5)
            if link is not None:
                await link.stop()
            await eng.stop()
        await self.scheduler.stop(0.5)
        if self.kvstore is not None:
            await self.kvstore.stop(0)


async def start_local_mesh(engines: list[LLMEngine], tokenizer, tenants=None, kvstore=None,
                           kvstore_fetch_timeout_s: float = 300.0, step_timeout_s: float = 3600.0,
                           metrics: bool = False, max_buffered_outputs: int = 256, tls: bool = True,
                           prefix_cache_scope: str = "tenant", scheduler_config=None,
                           http: bool = False, served_model_names: tuple[str, ...] = (),
                           scheduler_clock=None) -> LocalMesh:
    """Starts scheduler, one executor per engine, and a gateway, on free ports; with
    ``kvstore`` (a ``kvstore.store.KVStore``, or a ready ``Service``) a kvstore service
    too, every executor shares prefix blocks through it, and the scheduler follows its
    placements. With ``metrics`` every service serves Prometheus metrics on a free port
    (``LocalMesh.metrics_urls``). ``max_buffered_outputs``: each executor's bound on a
    stream's untaken outputs (C27). ``kvstore_fetch_timeout_s`` and ``step_timeout_s``
    (the step watchdog's bound) are by default past any real fetch or step of a loaded
    machine and any ``StepGate`` hold: no test's outcome depends on the machine's speed
    (the deadlines themselves are tested on fake clocks). ``tls``: mutual TLS with the
    test CA's role certificates (``LocalMesh.tls`` gives a caller's); False: plaintext.
    A ready kvstore ``Service`` passed in must speak the same. ``prefix_cache_scope``: the
    gateway's and executors' (``tenant`` or ``global``); ``scheduler_config``: a
    ``SchedulerConfig`` (None: the defaults); ``scheduler_clock``: the admission core's
    clock (None: ``time.monotonic``; a fake one holds rate-limit refills still)."""
    from kvstore.server import start_kvstore
    from kvstore.store import KVStore

    metrics_port = 0 if metrics else None
    def role(name: str) -> TLSConfig:
        return role_tls(name) if tls else PLAINTEXT

    kv_service = await start_kvstore(kvstore, 0, metrics_port=metrics_port, tls=role("kvstore")) \
        if isinstance(kvstore, KVStore) else kvstore
    clock = {} if scheduler_clock is None else {"clock": scheduler_clock}
    scheduler = await start_scheduler(0, config=scheduler_config, **clock,
                                      kvstore_address=kv_service.address if kv_service else None,
                                      metrics_port=metrics_port, tls=role("scheduler"))
    executors = []
    for i, engine in enumerate(engines):
        svc, async_engine, link = await start_executor(engine, 0, scheduler_address=scheduler.address,
                                                       executor_id=f"executor-{i}",
                                                       kvstore_address=kv_service.address if kv_service else None,
                                                       kvstore_fetch_timeout_s=kvstore_fetch_timeout_s,
                                                       step_timeout_s=step_timeout_s, metrics_port=metrics_port,
                                                       max_buffered_outputs=max_buffered_outputs,
                                                       tls=role("executor"), prefix_cache_scope=prefix_cache_scope)
        executors.append((svc, async_engine, link))
    e0 = engines[0]
    info = ModelInfo(e0.model_id, e0.max_model_len, e0.vocab_size, e0.revision, tuple(served_model_names))
    gateway = await start_gateway(tokenizer, info, scheduler.address, 0, tenants=tenants, metrics_port=metrics_port,
                                  tls=role("gateway"), prefix_cache_scope=prefix_cache_scope,
                                  http_port=0 if http else None)
    if executors:  # the gateway's readiness poll (every 0.5 s, 1 s timeout) has seen them: health and /ready say so
        await wait_for_condition(lambda: gateway.servicer.readiness.ready is True, what="the gateway ready")
    mesh = LocalMesh(scheduler, gateway, executors, kv_service, secure=tls)
    mesh._channel = channel(gateway.address, mesh.tls("client"))
    mesh.stub = gateway_pb2_grpc.GatewayStub(mesh._channel)
    return mesh


class StepGate:
    """A test hook on ``LLMEngine.step``: holds the engine thread before a step while
    the test acts, then lets it go. What the engine does between two of the test's
    actions is then fixed (no step runs while held), instead of a race between the
    test and the engine thread; step counts become exact.

    Use as a context manager around the part of a test that holds the engine; on
    exit the gate is open and ``engine.step`` is the engine's own again. An idle
    engine does not step: ``hold`` needs work in flight (or arriving).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._hold_at: int | None = None  # hold before a step once engine.num_steps >= this
        self._held = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._patched = False
        # (num_steps after the step, ids of the requests it made outputs for), for every
        # step run through the gate that made outputs
        self.outputs: list[tuple[int, list[str]]] = []

    def __enter__(self) -> StepGate:
        self._own_step = self.engine.__dict__.get("step")  # a hook already there stays under ours
        self._step = self.engine.step
        self.engine.step = self._gated_step
        self._patched = True
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        if self._own_step is None:
            del self.engine.step
        else:
            self.engine.step = self._own_step
        self._patched = False

    def _gated_step(self):
        hold_at = self._hold_at
        if hold_at is not None and self.engine.num_steps >= hold_at:
            opened = self._open
            self._held.set()
            opened.wait()
        outputs = self._step()
        if outputs:
            self.outputs.append((self.engine.num_steps, [o.request_id for o in outputs]))
        return outputs

    async def hold(self, after_steps: int = 0, timeout_s: float = 120.0) -> int:
        """Holds the engine thread before the first step it starts once it has run
        ``after_steps`` forward steps (``num_steps``); returns when it waits there,
        with the number of steps it has run.

        Raises:
            TimeoutError: the engine did not reach that step within ``timeout_s``
                (a hang bound, not a speed check).
        """
        assert self._patched, "use StepGate as a context manager"
        self._held = threading.Event()
        self._open = threading.Event()
        self._hold_at = after_steps
        await wait_for_condition(self._held.is_set, timeout_s, f"the engine held before step {after_steps + 1}")
        return self.engine.num_steps

    def release(self) -> None:
        """Lets the held engine thread run its step and every later one."""
        self._hold_at = None
        self._open.set()


async def wait_for_condition(predicate, timeout_s: float = 120.0, what: str = "condition") -> None:
    """Polls ``predicate()`` until it is true; ``timeout_s`` only bounds a hang.

    Raises:
        TimeoutError: still false after ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.005)
