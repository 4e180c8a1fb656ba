"""The Scheduler gRPC servicer: a thin layer over ``scheduler.admission.AdmissionCore``.

``Admit`` queues the request, streams queue positions while it waits and ends with
one Assignment. ``Connect`` is one executor's life: Register, then capacity
reports (with per-lease block counts for the tenant quotas) and prefix-cache
events (``KvEvents``, for prefix-aware routing); when the stream ends the
executor is gone at once, from the registry and from the prefix index; so is an
executor silent for ``executor_timeout_s`` (unreachable). Every state change
runs ``_dispatch`` which hands leases to waiting ``Admit`` calls.

Leases are signed here (``meshserve.lease_token``: Ed25519, the public key goes
to each executor in its ``RegisterAck``) and bound to request id, tenant,
executor, block budget and expiry. ``RenewLease`` keeps a lease alive; every
capacity report also sweeps the expired leases its executor no longer lists
(``AdmissionCore.expire_leases``). Request ids are scoped per tenant
(``meshserve.request_ids``): the core sees ``scoped_request_id(tenant, id)``.
An executor that stops (SIGTERM, scaled down) sends ``draining`` on its stream:
from then on nothing new is routed to it, and the scheduler answers
``drain_ack``; its leases stay valid until they are released or expire, and
``drain_ack`` with ``done`` follows once none is left. The
planner (``scheduler.planner``, run by ``scheduler.planner_loop``) learns from
every admitted request, every released lease and every executor's cold start
(``ExecutorRegister.startup_s``). With a start budget (scale to zero) an
Admit that finds no executor waits for one to register; each waiting Admit
call checks the budgets every ``QUEUE_UPDATE_INTERVAL_S``
(``AdmissionCore.expire_start_waits``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Callable

import grpc
from opentelemetry import trace

from meshserve import trace_attributes as ta
from meshserve.errors import (AlreadyExists, Cancelled, InvalidArgument, MeshError, NotFound, ResourceExhausted,
                             Unavailable)
from meshserve.grpc_server import EXECUTORS_HEALTH_SERVICE, NOT_SERVING, SERVING, Service
from meshserve.lease_token import LeaseClaims, LeaseSigner, new_nonce
from meshserve.metrics import priority_classes
from meshserve.request_ids import check_request_id, scoped_request_id
from meshserve.telemetry import context_from_grpc, record_error, tracer
from meshserve.timeouts import wait_for
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import scheduler_pb2 as pb
from meshserve.v1 import scheduler_pb2_grpc
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.kvstore_follower import KVStoreFollower
from scheduler.metrics import SchedulerMetrics
from scheduler.planner import Planner, PlannerConfig
from scheduler.planner_loop import PlannerLoop, ready_executors
from scheduler.quotas import quota_max_tokens
from scheduler.registry import ExecutorState, Lease

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
QUEUE_UPDATE_INTERVAL_S = 0.5
_LEASE_ID = re.compile(r"[0-9a-f]{32}")  # AdmitRequest.lease_id: a uuid4's hex


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Serves Admit, Release and Connect over one ``AdmissionCore``."""

    def __init__(self, core: AdmissionCore, on_registry_change: Callable[[int], None] | None = None,
                 signer: LeaseSigner | None = None, wall_clock: Callable[[], float] = time.time,
                 planner: Planner | None = None):
        self.core = core
        self.signer = signer or LeaseSigner()
        self.wall_clock = wall_clock  # stamps the leases' expiry (Unix s)
        self.planner = planner or Planner(PlannerConfig(), start=core.clock())
        self.planner_loop = PlannerLoop(self.planner, core, core.clock)
        self.metrics = SchedulerMetrics(core, planner=self.planner)
        limits = (core.config.tenant_limits or {}).values()
        self.metrics.priority_label.reserve(priority_classes((), (t.max_priority for t in limits)))
        self._waiters: dict[str, asyncio.Future[Lease]] = {}
        self._on_registry_change = on_registry_change or (lambda _n: None)

    def _dispatch(self) -> None:
        for req, lease in self.core.dispatch():
            fut = self._waiters.pop(req.request_id, None)
            if fut is None or fut.done():
                self.core.release(lease.lease_id)
            else:
                fut.set_result(lease)
        self.planner_loop.observe()  # what is left queued: the planner's saturation sample

    def sign(self, lease: Lease, executor: ExecutorState, request_id: str, priority: int) -> bytes:
        """The signed lease of ``lease`` on ``executor`` for the caller's (unscoped)
        ``request_id``, bounding its tokens to its tenant's quota (``quota_max_tokens``)."""
        ttl = self.core.config.lease_ttl_s
        max_tokens = quota_max_tokens(self.core.quotas.limit(lease.tenant), lease.n, executor.block_size,
                                      lease.num_prompt_tokens)
        return self.signer.sign(LeaseClaims(
            lease_id=lease.lease_id, request_id=request_id, tenant=lease.tenant, executor_id=lease.executor_id,
            num_blocks=lease.num_blocks, expires_at_unix_s=self.wall_clock() + ttl, nonce=new_nonce(),
            priority=priority, max_tokens=max_tokens))

    def _expire(self) -> None:
        """Releases expired leases nobody runs (their gateway is gone), then dispatches."""
        expired = self.core.expire_leases()
        for lease in expired:
            log.warning("lease %s of tenant %s expired (not renewed, not running on %s): released",
                        lease.lease_id, lease.tenant, lease.executor_id)
        if expired:
            self._dispatch()

    def _fail_orphans(self) -> None:
        """Fails queued requests whose model no executor serves any more (with a start
        budget, scale to zero, they wait for a new one within it instead)."""
        if self.core.config.start_budget_s is not None:
            self._expire_start_waits()
            return
        for req in self.core.queued():
            if not self.core.servable(req):
                self.core.cancel(req.request_id)
                self._fail(req.request_id, Unavailable("no executor is serving the model any more"))

    def _expire_start_waits(self) -> None:
        """Scale to zero: ends the waits whose start budget ran out (UNAVAILABLE)
        or that the executors which registered cannot hold."""
        for req, exc in self.core.expire_start_waits():
            log.warning("request %s: %s", req.request_id, exc)
            self._fail(req.request_id, exc)

    def _fail(self, request_id: str, exc: Exception) -> None:
        """Ends a waiting Admit call with ``exc``."""
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        check_request_id(request.request_id)
        scoped_id = scoped_request_id(request.tenant, request.request_id)
        if request.num_prompt_tokens < 0 or request.max_tokens < 0 or request.n < 0:
            raise InvalidArgument("num_prompt_tokens, max_tokens and n must be >= 0")
        _check_block_hashes(request)
        if request.lease_id and not _LEASE_ID.fullmatch(request.lease_id):
            raise InvalidArgument("lease_id must be 32 lowercase hex digits (a uuid4's hex) or empty")
        if request.lease_id and self.core.lease_id_in_use(request.lease_id):
            raise AlreadyExists(f"lease_id {request.lease_id!r} is already in use")
        span = _tracer.start_span("scheduler.admit", context=context_from_grpc(context), kind=trace.SpanKind.SERVER)
        try:
            span.set_attributes({ta.REQUEST_ID: request.request_id, ta.TENANT: request.tenant,
                                 ta.PRIORITY: request.priority, ta.REQUEST_MODEL: request.model})
            req = AdmissionRequest(
                request_id=scoped_id,
                tenant=request.tenant,
                priority=request.priority,
                num_prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                model=request.model,
                n=max(1, request.n),
                block_hashes=tuple(request.block_hashes),
                hash_block_size=request.hash_block_size,
                lease_id=request.lease_id,
            )
            try:
                displaced = self.core.submit(req)
            except AlreadyExists:  # the core names the scoped id: name the caller's
                raise AlreadyExists(f"request_id {request.request_id!r} is already queued or running") from None
            for victim in displaced:
                self._fail(victim.request_id, ResourceExhausted(
                    "displaced from the full admission queue by a higher-priority request",
                    self.core.retry_delay_s()))
            self.planner.on_arrival(self.core.clock(), int(req.cost))
            fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
            self._waiters[scoped_id] = fut
            self._dispatch()
            handed_over = False
            try:
                last_position = None
                while not fut.done():
                    position = self.core.position(scoped_id)
                    if position >= 0 and position != last_position:
                        if last_position is None:  # the position at which it joined the queue
                            span.set_attribute(ta.QUEUE_POSITION, position)
                        last_position = position
                        yield pb.AdmitEvent(
                            queued=pb.AdmitQueued(
                                position=position, estimated_wait_s=self.core.estimated_wait_s(position)
                            )
                        )
                    try:
                        await wait_for(asyncio.shield(fut), QUEUE_UPDATE_INTERVAL_S)
                    except asyncio.TimeoutError:
                        if self.core.config.start_budget_s is not None:
                            self._expire_start_waits()
                lease = fut.result()
                executor = self.core.registry.get(lease.executor_id)
                if executor is None:  # it dropped off between dispatch and now: its lease is released below
                    raise Unavailable(f"executor {lease.executor_id} left before the request could start there")
                queue_s = max(0.0, lease.assigned_at - req.arrival)
                span.set_attributes({ta.EXECUTOR_ID: lease.executor_id, ta.QUEUE_WAIT_S: queue_s})
                self.metrics.on_assigned(request.tenant, req.priority, queue_s)  # the ceiling applied
                yield pb.AdmitEvent(
                    assignment=pb.Assignment(
                        executor_id=lease.executor_id,
                        address=executor.address,
                        lease_id=lease.lease_id,
                        queue_s=queue_s,
                        lease=self.sign(lease, executor, request.request_id, req.priority),
                        lease_ttl_s=self.core.config.lease_ttl_s,
                    )
                )
                handed_over = True
            finally:
                if not fut.done():
                    self.core.cancel(scoped_id)
                    self._waiters.pop(scoped_id, None)
                    fut.cancel()
                elif not handed_over and not fut.cancelled() and fut.exception() is None:
                    self.core.release(fut.result().lease_id)
                    self._dispatch()
        except Exception as exc:
            record_error(span, exc)
            if isinstance(exc, MeshError) and not isinstance(exc, Cancelled):  # refused, displaced, no executor
                self.metrics.on_rejected(request.tenant, request.priority, exc)
            raise
        finally:
            span.end()

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        tokens = request.num_completion_tokens if request.HasField("num_completion_tokens") else None
        generated = request.num_generated_tokens if request.HasField("num_generated_tokens") else None
        for name, value in (("num_completion_tokens", tokens), ("num_generated_tokens", generated)):
            if value is not None and value < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {value}")
        if generated is None:
            generated = tokens
        with _tracer.start_as_current_span("scheduler.release", context=context_from_grpc(context),
                                           kind=trace.SpanKind.SERVER,
                                           attributes={"meshserve.lease_id": request.lease_id}):
            lease = self.core.lease(request.lease_id)
            if lease is not None:
                done = generated if generated is not None else lease.n * (lease.predicted_output_tokens or 0)
                self.planner.on_served(self.core.clock(), lease.num_prompt_tokens + done)
            if self.core.release(request.lease_id, tokens, generated):
                self._dispatch()
            elif (withdrawn := self.core.withdraw(request.lease_id)) is not None:  # released before its grant
                self._fail(withdrawn.request_id, Cancelled("the caller released its lease id before it was granted"))
        return pb.ReleaseResponse()

    async def RenewLease(self, request: pb.RenewLeaseRequest, context: grpc.aio.ServicerContext
                         ) -> pb.RenewLeaseResponse:
        left = self.core.renew(request.lease_id)
        if left is None:
            raise NotFound(f"no lease {request.lease_id!r} (released, expired or never issued)")
        return pb.RenewLeaseResponse(expires_in_s=left)

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "register":
            raise InvalidArgument("the first message of Connect must be a register message")
        reg = first.register
        if not reg.executor_id or not reg.address or reg.num_blocks <= 0 or reg.block_size <= 0:
            raise InvalidArgument("register needs executor_id, address, num_blocks > 0 and block_size > 0")
        if reg.kvstore_namespace and len(reg.kvstore_namespace) != HASH_BYTES:
            raise InvalidArgument(f"kvstore_namespace must be {HASH_BYTES} bytes, got {len(reg.kvstore_namespace)}")
        if self.core.registry.get(reg.executor_id) is not None:
            raise InvalidArgument(f"executor id {reg.executor_id!r} is already connected")
        state = ExecutorState(
            executor_id=reg.executor_id,
            address=reg.address,
            model=reg.model,
            num_blocks=reg.num_blocks,
            block_size=reg.block_size,
            max_model_len=reg.max_model_len,
            pool=reg.pool or "default",
            kvstore_namespace=bytes(reg.kvstore_namespace),
        )
        self.core.registry.add(state)
        if reg.startup_s > 0:
            self.planner.on_cold_start(reg.startup_s)
        self._on_registry_change(len(list(self.core.registry)))
        log.info("executor %s registered at %s (%d blocks)", reg.executor_id, reg.address, reg.num_blocks)
        messages = aiter(request_iterator)
        drained = False
        timeout_s = self.core.config.executor_timeout_s
        try:
            yield pb.SchedulerCommand(registered=pb.RegisterAck(executor_id=reg.executor_id,
                                                                lease_public_key=self.signer.public_key))
            self._dispatch()
            while True:
                try:
                    msg = await wait_for(anext(messages), timeout_s)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    log.warning("executor %s silent for %.1f s: dropped as unreachable", reg.executor_id, timeout_s)
                    break
                kind = msg.WhichOneof("kind")
                if kind == "capacity":
                    cap = msg.capacity
                    self.core.on_capacity(reg.executor_id, cap.num_free_blocks, cap.num_running, cap.num_waiting,
                                          cap.lease_ids, dict(cap.lease_num_blocks))
                    self._expire()
                    self._dispatch()
                elif kind == "kv_events":
                    ev = msg.kv_events
                    _check_hashes(list(ev.stored) + list(ev.removed), "kv_events")
                    self.core.on_kv_events(reg.executor_id, ev.stored, ev.removed, ev.reset)
                elif kind == "draining":
                    self.core.drain_executor(reg.executor_id)
                    self._on_registry_change(len(list(self.core.registry)))
                    log.info("executor %s draining (grace %.1f s): no new requests routed to it",
                             reg.executor_id, msg.draining.grace_s)
                    yield pb.SchedulerCommand(drain_ack=pb.DrainAck(executor_id=reg.executor_id))
                if state.draining and not self.core.num_leases(reg.executor_id) and not drained:
                    drained = True  # every lease routed to it (detached ones too) is released: it may leave
                    yield pb.SchedulerCommand(drain_ack=pb.DrainAck(executor_id=reg.executor_id, done=True))
        finally:
            detached = self.core.remove_executor(reg.executor_id)
            self._on_registry_change(len(list(self.core.registry)))
            log.info("executor %s disconnected (%d leases detached: they end when released or expired, unless it "
                     "registers again and lists them)", reg.executor_id, len(detached))
            self._fail_orphans()
            self._dispatch()


HASH_BYTES = 16


def _check_hashes(hashes, what: str) -> None:
    bad = next((h for h in hashes if len(h) != HASH_BYTES), None)
    if bad is not None:
        raise InvalidArgument(f"{what}: every chain hash must be {HASH_BYTES} bytes, got {len(bad)}")


def _check_block_hashes(request: pb.AdmitRequest) -> None:
    """Raises InvalidArgument for hashes of the wrong size or without a block size."""
    _check_hashes(request.block_hashes, "block_hashes")
    if request.block_hashes and request.hash_block_size <= 0:
        raise InvalidArgument(f"hash_block_size must be > 0 with block_hashes, got {request.hash_block_size}")
    if request.hash_block_size > 0 and len(request.block_hashes) > request.num_prompt_tokens // request.hash_block_size:
        raise InvalidArgument(f"{len(request.block_hashes)} block hashes for {request.num_prompt_tokens} prompt "
                              f"tokens in blocks of {request.hash_block_size}")


async def start_scheduler(port: int, host: str = "127.0.0.1", config: SchedulerConfig | None = None,
                          kvstore_address: str | None = None, metrics_port: int | None = None,
                          tls: TLSConfig = PLAINTEXT, planner: PlannerConfig | None = None,
                          health_port: int | None = None, clock: Callable[[], float] = time.monotonic) -> Service:
    """Starts a Scheduler service on ``host:port`` (0 picks a free port); SERVING at once.
    ``tls``: its certificate (role scheduler) for its port and its kvstore channel, or plaintext.
    With ``metrics_port`` (0: a free one) it serves Prometheus metrics
    (``scheduler.metrics``) as ``service.metrics``.

    With ``kvstore_address`` it follows that kvstore's placement events
    (``scheduler.kvstore_follower``) and routes with its blocks (``scheduler.routing``).

    Its health service also answers for ``EXECUTORS_HEALTH_SERVICE``: SERVING while
    at least one executor is registered and not draining (the gateway's readiness
    follows it). ``planner``: the autoscaling planner's settings (default
    ``PlannerConfig()``); its loop runs with the service.
    ``health_port``: a plaintext health-only port (``Service``; None: none).
    ``clock``: the admission core's and the planner's clock (seconds; tests pass a fake one).
    """
    service = Service("meshserve.v1.Scheduler", port, host, tls, health_port=health_port)

    def registry_changed(_num_executors: int) -> None:
        status = SERVING if ready_executors(servicer.core) else NOT_SERVING
        asyncio.ensure_future(service.health.set(EXECUTORS_HEALTH_SERVICE, status))

    core = AdmissionCore(config, clock)
    servicer = SchedulerServicer(core, registry_changed,
                                 planner=Planner(planner or PlannerConfig(), start=core.clock()))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, service.server)
    service.servicer = servicer  # type: ignore[attr-defined]
    if kvstore_address:
        follower = KVStoreFollower(kvstore_address, servicer.core.kvstore_index, tls=tls)
        service.background.append(follower)
        service.kvstore_follower = follower  # type: ignore[attr-defined]
    service.background.append(servicer.planner_loop)
    service.serve_metrics(servicer.metrics.registry, metrics_port)
    await service.start()
    for task in service.background:
        task.start()
    await service.health.set(EXECUTORS_HEALTH_SERVICE, NOT_SERVING)
    await service.set_serving(True)
    return service
