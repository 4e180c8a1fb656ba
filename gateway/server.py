"""The gRPC adapter of the gateway: ``meshserve.v1.Gateway`` over ``GatewayCore``.

``Generate``: authenticate (API key in the call's metadata → tenant), turn the
``GenerateRequest`` into a ``GenerationRequest``, run it through the core
(``gateway.generation``) as a child of the caller's trace context, and send each
event as a ``GenerateResponse`` (queue update, delta, one result per choice).
``SubmitTask``/``GetTask``/``CancelTask`` are the task adapter's
(``gateway.task_api``) over the same core; ``ListModels`` names the served models
(``ModelInfo.names``). ``start_gateway`` also starts the HTTP adapter
(``gateway.http``) over the same core when given an HTTP port. The core raises domain errors; the
server's one ``ErrorInterceptor`` (``meshserve.errors``) maps them to status codes.
A caller that goes away cancels the call's task: the core's stream is closed, which
cancels the executor call and releases the lease. A ``Generate`` still running when a
stopping gateway's grace runs out is ended the same way, UNAVAILABLE saying why
(``gateway.running``; ``stop_gateway``).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc

from gateway.callbacks import CallbackSender
from gateway.generation import GatewayCore
from gateway.mesh_client import GrpcMeshClient
from gateway.prompt_limits import PromptLimits
from gateway.proto_convert import request_from_proto, response_of
from gateway.readiness import ReadinessProbe
from gateway.request import ModelInfo, SpanOptions
from gateway.result_cache import ResultCache
from gateway.running import END_WAIT_S
from gateway.task_api import TaskAPI
from gateway.task_readiness import TASKS_HEALTH_SERVICE, TaskStoreProbe
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve import structured_output
from meshserve.errors import InvalidArgument
from meshserve.grpc_server import NOT_SERVING, SERVING, Service
from meshserve.metrics import priority_classes
from meshserve.telemetry import context_from_grpc
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and the async task API for one model.

    Args:
        core: the gateway core (its mesh client, result cache and metrics).
        tenants: API keys → tenants.
        tasks: the task adapter over the same core.
    """

    def __init__(self, core: GatewayCore, tenants: TenantRegistry, tasks: TaskAPI):
        self.core = core
        self.tenants = tenants
        self.tasks = tasks
        self.readiness: ReadinessProbe | None = None  # set by start_gateway

    async def close(self) -> None:
        """Stops the readiness probe and every running task, then closes the core's connections."""
        if self.readiness is not None:
            await self.readiness.stop()
        await self.tasks.close()
        await self.core.close()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received_at = time.monotonic()
        tenant = self.tenants.authenticate(context.invocation_metadata())
        if request.callback_url:
            raise InvalidArgument("callback_url is for SubmitTask only")
        events = self.core.running.guard(self.core.generate(
            request_from_proto(request), tenant, SpanOptions(parent=context_from_grpc(context)), received_at))
        async with aclosing(events):
            async for event in events:
                yield response_of(event)

    async def SubmitTask(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        return await self.tasks.submit(request, context)

    async def GetTask(self, request: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext):
        return await self.tasks.get(request, context)

    async def CancelTask(self, request: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext):
        return await self.tasks.cancel(request, context)

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        self.tenants.authenticate(context.invocation_metadata())
        info = self.core.model
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelCard(id=name, root=info.model_id, max_model_len=info.max_model_len)
            for name in info.names])


async def start_gateway(
    tokenizer, model: ModelInfo, scheduler_address: str, port: int, host: str = "127.0.0.1",
    tenants: TenantRegistry | None = None, hash_block_size: int = 16,
    result_cache: ResultCache | None = None, tasks: TaskRunner | None = None, metrics_port: int | None = None,
    tls: TLSConfig = PLAINTEXT, prompt_limits: PromptLimits | None = None, prefix_cache_scope: str = "tenant",
    callbacks: CallbackSender | None = None, http_port: int | None = None, health_port: int | None = None,
    http_body_timeout_s: float | None = None,
) -> Service:
    """Starts the Gateway service. Its health is SERVING while the scheduler has an
    executor registered (``gateway.readiness``), checked every 0.5 s; the task
    path's, ``meshserve.v1.Gateway.Tasks``, while the task store answers
    (``gateway.task_readiness``).

    ``hash_block_size``: tokens per block of the prompt chain hashes sent for
    prefix-aware routing (the executors' ``block_size``; 0: none sent).
    ``result_cache``: the result cache (None: off). ``tasks``: the async task
    runner over its store (None: in memory, defaults); with a shared store it
    starts taking over tasks other gateways left. ``callbacks``: the task callback
    sender with its allow-list (None: callbacks refused).
    ``metrics_port``: serve Prometheus metrics (``gateway.metrics``) there (0: a
    free port; None: none), as ``service.metrics``.
    ``tls``: the gateway's certificate (role gateway): its public port serves TLS
    with it (a client certificate is optional there: the API key authenticates)
    and it is the gateway's identity towards the scheduler and the executors.
    ``prompt_limits``: prompt size caps checked before tokenizing (None: the defaults).
    ``prefix_cache_scope``: ``tenant`` or ``global``, as the executors' (routing hashes).
    ``http_port``: serve the OpenAI-compatible HTTP API (``gateway.http``) there, in
    this event loop over the same core (0: a free port; None: none), as
    ``service.http`` (an ``HttpServer``); ``service.stop(grace_s)`` drains it alongside
    the gRPC server, with the same grace. ``http_body_timeout_s``: its longest wait for
    the next part of a request body not all arrived (then 408; None: 30 s,
    ``gateway.http.body_guards.BODY_TIMEOUT_S``).
    ``health_port``: a plaintext health-only port (``Service``; None: none).
    """
    structured_output.preload()  # the first constrained request does not import xgrammar on the loop
    service = Service("meshserve.v1.Gateway", port, host, tls, public=True, health_port=health_port)
    mesh = GrpcMeshClient(scheduler_address, tls)
    core = GatewayCore(tokenizer, model, mesh, hash_block_size, result_cache, prompt_limits=prompt_limits,
                       prefix_cache_scope=prefix_cache_scope)
    tenants = tenants or TenantRegistry.open()
    core.metrics.priority_label.reserve(priority_classes((t.default_priority for t in tenants.tenants),
                                                        (t.max_priority for t in tenants.tenants)))
    task_api = TaskAPI(core, tenants, tasks or TaskRunner(MemoryTaskStore()), callbacks)
    servicer = GatewayServicer(core, tenants, task_api)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, service.server)
    service.servicer = servicer  # type: ignore[attr-defined]
    service.serve_metrics(core.metrics.registry, metrics_port)
    await service.start()
    servicer.readiness = ReadinessProbe(service, mesh.scheduler_channel)
    await servicer.readiness.check()
    servicer.readiness.start()
    task_api.runner.start()
    store_probe = TaskStoreProbe(task_api.runner.store.check, lambda ready: service.health.set(
        TASKS_HEALTH_SERVICE, SERVING if ready else NOT_SERVING))
    await store_probe.check()
    store_probe.start()
    service.background.append(store_probe)
    servicer.task_store_probe = store_probe
    task_api.store_ready = lambda: store_probe.ready is not False
    service.http = None  # type: ignore[attr-defined]
    if http_port is not None:
        from gateway.http.app import create_app  # FastAPI: imported only when HTTP is served
        from gateway.http.server import HttpServer

        probe = servicer.readiness
        app = create_app(core, tenants, task_api, lambda: bool(probe.ready), core.metrics.registry,
                         tasks_ready=task_api.store_ready,
                         **({} if http_body_timeout_s is None else {"body_timeout_s": http_body_timeout_s}))
        service.http = HttpServer(app, http_port, host)  # type: ignore[attr-defined]
        try:
            await service.http.start()
        except BaseException:
            await service.stop(0)
            await servicer.close()
            raise
        service.drained_alongside.append(service.http.stop)  # its calls in flight get the gRPC ones' grace
    return service


async def stop_gateway(service: Service, grace_s: float) -> None:
    """Stops a gateway from ``start_gateway`` without cutting what it serves: it
    claims no more tasks other gateways left (``TaskRunner.drain``), reports
    NOT_SERVING and refuses new calls, and lets the gRPC and HTTP calls in flight
    and its running tasks finish for at most ``grace_s`` seconds. Then it ends the
    requests still running itself (``RunningRequests.stop``: UNAVAILABLE saying the
    grace ran out, the executor calls cancelled, the leases released), giving them
    at most ``END_WAIT_S`` to send it before its servers stop; it hands the tasks
    still running back to a shared store (a memory store's end FAILED with
    UNAVAILABLE) and closes its connections."""
    servicer = service.servicer  # type: ignore[attr-defined]
    calls_done = asyncio.Event()  # a SubmitTask in flight may still add a task to drain

    async def stop_calls() -> None:
        try:  # the servers' own grace outlasts the requests' end, so they never cut one the gateway ends
            await asyncio.gather(service.stop(grace_s + END_WAIT_S), servicer.core.running.stop(grace_s))
        finally:
            calls_done.set()

    await asyncio.gather(servicer.tasks.runner.drain(grace_s, calls_done), stop_calls())
    await servicer.close()
