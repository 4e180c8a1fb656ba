"""The async task RPCs of the Gateway: a thin adapter over ``GatewayCore`` and
``gateway.task_runner``.

``SubmitTask`` authenticates and validates exactly as ``Generate`` (the core's
``prepare``), so a bad request fails at once; then the runner stores a QUEUED
record and runs the generation in the background through the core's ``run``
(result cache included), collecting the choices into the result (a serialized
``TaskStatus`` with its ``TaskChoice`` list). The id is ``task-<32 hex>``; the
generation's request id is the caller's ``request_id`` or the task id.

Traces: the ``gateway.submit_task`` span (SERVER, child of the caller's
context) is the parent of the task's generation span (``{operation} {model}``,
INTERNAL), so scheduler, executor and kvstore spans of the task are all in the
submit trace. The submit span's ``traceparent`` is stored with the task; each
``gateway.get_task`` / ``gateway.cancel_task`` span starts its own trace (or
continues the caller's) and carries a span *link* to the submit span.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from contextlib import aclosing
from typing import Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter

from gateway.callback_delivery import CallbackDelivery
from gateway.callbacks import CallbackPolicy, CallbackSender
from gateway.collector import ChoiceCollector
from gateway.events import Queued
from gateway.generation import GatewayCore
from gateway.mesh_run import refused_for_now
from gateway.proto_convert import request_from_proto, task_result
from gateway.request import Prepared, SpanOptions
from gateway.task_run import TaskHooks, Work
from gateway.task_runner import TaskRunner
from gateway.task_store import TaskRecord, TaskState
from gateway.task_wait import WaitingLines
from gateway.tenants import Tenant, TenantRegistry
from meshserve import trace_attributes as ta
from meshserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from meshserve.request_ids import MAX_REQUEST_ID_LEN, attempt_request_id
from meshserve.telemetry import context_from_grpc, record_error, tracer
from meshserve.v1 import gateway_pb2

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
_w3c = TraceContextTextMapPropagator()



def traceparent_of(span: trace.Span) -> str:
    """The W3C ``traceparent`` of ``span`` ("" when it is not recording a valid context)."""
    carrier: dict[str, str] = {}
    _w3c.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def span_context_of(traceparent: str) -> trace.SpanContext | None:
    """The span context a stored ``traceparent`` names (None when empty or malformed)."""
    if not traceparent:
        return None
    ctx = trace.get_current_span(_w3c.extract({"traceparent": traceparent})).get_span_context()
    return ctx if ctx.is_valid else None


def to_status(record: TaskRecord) -> gateway_pb2.TaskStatus:
    """The ``TaskStatus`` message of a record (its result bytes are a serialized TaskStatus
    holding the choices)."""
    status = gateway_pb2.TaskStatus.FromString(record.result) if record.result else gateway_pb2.TaskStatus()
    status.task_id, status.state, status.request_id = record.task_id, int(record.state), record.request_id
    status.tenant = record.tenant
    status.created_at_unix_s, status.started_at_unix_s = record.created_at, record.started_at
    status.finished_at_unix_s = record.finished_at
    if record.error_code:
        status.error.code, status.error.message = record.error_code, record.error_message
    if record.queue_position >= 0:
        status.queue_position, status.estimated_wait_s = record.queue_position, record.estimated_wait_s
    elif record.state == TaskState.QUEUED and record.estimated_wait_s > 0:  # refused for now, or a retry's backoff
        status.estimated_wait_s = record.estimated_wait_s
    status.attempt, status.last_error = record.attempt, record.last_error
    if record.callback_url:
        status.callback.url, status.callback.attempts = record.callback_url, record.callback_attempts
        status.callback.state = _CALLBACK_STATES[record.callback_state or "pending"]
        status.callback.error = record.callback_error
    return status


_CALLBACK_STATES = {"pending": gateway_pb2.CALLBACK_STATE_PENDING, "delivered": gateway_pb2.CALLBACK_STATE_DELIVERED,
                    "failed": gateway_pb2.CALLBACK_STATE_FAILED}


class TaskAPI:
    """SubmitTask, GetTask and CancelTask over a ``GatewayCore``.

    Durable tasks: the submitted ``GenerateRequest`` is stored with the task, and
    the runner's ``resume`` builds the work again from it (a retry after its
    executor went away, or a takeover after its gateway did), for the tenant the
    record names. The runner's ``on_final`` POSTs the callback (``gateway.callback_delivery``).

    Args:
        core: the gateway core that runs the tasks' generations.
        tenants: API keys → tenants.
        runner: the task runner over its store (its ``resume`` and ``on_final`` are set here).
        callbacks: the callback sender with its allow-list (None: a task naming a
            ``callback_url`` is refused).
    """

    def __init__(self, core: GatewayCore, tenants: TenantRegistry, runner: TaskRunner,
                 callbacks: CallbackSender | None = None):
        self.core = core
        self.tenants = tenants
        self.runner = runner
        self.callbacks = callbacks
        self.lines = WaitingLines(runner.max_wait_s)  # tasks waiting out refusals, a line per tenant
        self.store_ready: Callable[[], bool] = lambda: True  # the task store answers (``TaskStoreProbe``)
        posts = Counter("meshserve_task_callback_posts", "Callback POSTs by outcome (delivered, failed)",
                        ["outcome"], registry=core.metrics.registry)
        outcomes = Counter("meshserve_task_callbacks", "Task callbacks by final outcome (delivered, failed)",
                           ["outcome"], registry=core.metrics.registry)
        runner.resume = self._resume
        runner.delivers_callbacks = callbacks is not None
        if callbacks is not None:
            runner.on_final = CallbackDelivery(runner.store, callbacks, runner.owner, to_status, posts, outcomes)

    async def close(self) -> None:
        """Stops the runner (running tasks are handed back to a shared store, or end
        FAILED, UNAVAILABLE in memory) and closes the store."""
        await self.runner.close()
        await self.runner.store.close()

    async def submit(self, request: gateway_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> gateway_pb2.TaskHandle:
        """SubmitTask: validates, stores a QUEUED task, starts its generation.

        Raises:
            Unauthenticated, InvalidArgument, AlreadyExists: as Generate, before anything is stored.
            ResourceExhausted: its tenant has its bound of unfinished tasks (its
                ``max_unfinished_tasks``, else the runner's ``max_unfinished_per_tenant``),
                or the memory store is full of unfinished tasks; nothing is stored.
            Unavailable: the Redis store cannot be reached (at once while the task
                path is not ready: ``gateway.task_readiness``).
        """
        received_at = time.monotonic()
        tenant = self.tenants.authenticate(context.invocation_metadata())
        task_id = f"task-{uuid.uuid4().hex}"
        span = _tracer.start_span(ta.SPAN_SUBMIT_TASK, context=context_from_grpc(context), kind=trace.SpanKind.SERVER,
                                  attributes={ta.TASK_ID: task_id, ta.TENANT: tenant.name})
        try:
            callback_url = self._check_callback(request.callback_url, tenant)
            prepared = await self.core.prepare_async(request_from_proto(request, default_request_id=task_id), tenant,
                                                     received_at)
            span.set_attribute(ta.REQUEST_ID, prepared.request_id)
            traceparent = traceparent_of(span)
            record = TaskRecord(task_id, tenant.name, request_id=prepared.request_id, created_at=time.time(),
                                traceparent=traceparent, request=request.SerializeToString(),
                                callback_url=callback_url, callback_state="pending" if callback_url else "")
            options = SpanOptions(parent=trace.set_span_in_context(span), kind=trace.SpanKind.INTERNAL, stream=False,
                                  attributes={ta.TASK_ID: task_id})
            try:
                if not self.store_ready():
                    raise Unavailable("the task store does not answer; retry later (synchronous Generate still "
                                      "serves)")
                await self.runner.submit(record, lambda hooks: self._work(prepared, options, hooks),
                                         tenant.max_unfinished_tasks)
            except BaseException as exc:
                self.core.end(prepared, exc)
                raise
            span.set_attribute(ta.TASK_STATE, record.state.name)
            return gateway_pb2.TaskHandle(task_id=task_id, state=int(record.state))
        except Exception as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    def _check_callback(self, url: str, tenant: Tenant) -> str:
        """The task's callback URL ("" for none): in the gateway's allow-list and, when
        the tenant has one, in the tenant's ``callback_allow``. Raises InvalidArgument
        (see ``gateway.callbacks``)."""
        if not url:
            return ""
        if self.callbacks is None:
            raise InvalidArgument("callback_url: callbacks are off on this gateway (no --callback-allow)")
        url = self.callbacks.policy.check(url)
        if tenant.callback_allow and not CallbackPolicy(tenant.callback_allow).lists(url):
            raise InvalidArgument(f"callback_url is not in tenant {tenant.name!r}'s callback_allow list")
        return url

    @staticmethod
    def _span_options(task_id: str, traceparent: str) -> SpanOptions:
        """A resumed generation's span options: INTERNAL, child of the stored submit span."""
        parent = _w3c.extract({"traceparent": traceparent}) if traceparent else None
        return SpanOptions(parent=parent, kind=trace.SpanKind.INTERNAL, stream=False, attributes={ta.TASK_ID: task_id})

    async def _work(self, prepared: Prepared, options: SpanOptions, hooks: TaskHooks) -> bytes:
        """A task's generation: the core's events collected into the task's result;
        queue updates go to the task's record.

        A refusal the scheduler gives with a retry delay before any executor was
        assigned (RESOURCE_EXHAUSTED: its tenant is over ``requests_per_s`` or
        ``tokens_per_min``, the admission queue is full, a higher-priority request
        displaced it) is waited out in the line of its tenant and priority
        (``gateway.task_wait``), the task QUEUED with the refusal as its
        ``last_error``, and the same prepared request (its request id held, its
        metrics open: one request however long it waits) is run again: the caller
        was promised a result, not a 429. A refusal with no retry delay (the request
        alone exceeds its tenant's KV quota), or a wait past ``max_wait_s``, fails
        the task with RESOURCE_EXHAUSTED.
        """
        place = self.lines.place(prepared.tenant, prepared.priority)
        try:
            if place.busy and not await self.core.is_cached(prepared):
                await hooks.held("waiting behind its tenant's tasks refused for now", 0.0)
                await place.join_if_busy()
            while True:
                collector, assigned = ChoiceCollector(), False

                async def on_assigned() -> None:
                    nonlocal assigned
                    assigned = True
                    place.admitted()
                    await hooks()
                try:
                    async with aclosing(self.core.run(prepared, options, on_assigned=on_assigned,
                                                      hold_refusals=True)) as events:
                        async for event in events:
                            place.admitted()  # queued at the scheduler, or answered from the cache
                            if isinstance(event, Queued):
                                await hooks.queued(event.position, event.estimated_wait_s)
                            collector.feed(event)
                    if not assigned:  # the result cache answered: it started (and ended) now
                        await hooks()
                    return task_result(collector.choices())
                except ResourceExhausted as exc:
                    if not refused_for_now(exc, prepared):
                        raise
                    log.info("task %s refused for now (%s); it waits %.2f s", hooks.task_id, exc,
                             place.delay_s(exc))
                    await hooks.held(f"RESOURCE_EXHAUSTED: {exc}", place.delay_s(exc))
                    await place.wait(exc)
        except BaseException as exc:
            self.core.end(prepared, exc)  # a refusal it held, then the bound or a cancel (a no-op if ended)
            raise
        finally:
            place.leave()

    def _resume(self, record: TaskRecord) -> Work:
        """The work of a stored task again (a retry or a takeover): its request prepared
        anew for the record's tenant. Raises MeshError when it cannot be (e.g. no request stored)."""
        if not record.request:
            raise InvalidArgument(f"task {record.task_id} has no stored request to run again")
        tenant = self.tenants.get(record.tenant) or Tenant(record.tenant)
        message = gateway_pb2.GenerateRequest.FromString(record.request)
        options = self._span_options(record.task_id, record.traceparent)

        # the scheduler may still hold the lease of an earlier attempt (its gateway died
        # holding it) under the plain id
        request_id = attempt_request_id(message.request_id or record.task_id, record.attempt)

        async def work(hooks: TaskHooks) -> bytes:
            request = dataclasses.replace(request_from_proto(message), request_id=request_id)
            return await self._work(await self.core.prepare_async(request, tenant), options, hooks)
        return work

    async def get(self, query: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext) -> gateway_pb2.TaskStatus:
        """GetTask. Raises NotFound (unknown, expired or another tenant's), InvalidArgument (empty id)."""
        return await self._answer(ta.SPAN_GET_TASK, query, context, self.runner.get)

    async def cancel(self, query: gateway_pb2.TaskQuery,
                     context: grpc.aio.ServicerContext) -> gateway_pb2.TaskStatus:
        """CancelTask: cancels an unfinished task (its executor call too). Raises as ``get``."""
        return await self._answer(ta.SPAN_CANCEL_TASK, query, context, self.runner.cancel)

    async def _answer(self, name: str, query: gateway_pb2.TaskQuery, context, action) -> gateway_pb2.TaskStatus:
        """One GetTask/CancelTask call: its span (linked to the submit span) around ``action``."""
        tenant = self.tenants.authenticate(context.invocation_metadata())
        if len(query.task_id) > MAX_REQUEST_ID_LEN:  # before it is echoed into spans, errors or trailers
            raise InvalidArgument(f"task_id has {len(query.task_id)} characters; the limit is {MAX_REQUEST_ID_LEN}")
        span = _tracer.start_span(name, context=context_from_grpc(context), kind=trace.SpanKind.SERVER,
                                  attributes={ta.TASK_ID: query.task_id, ta.TENANT: tenant.name})
        try:
            if not query.task_id:
                raise InvalidArgument("task_id is required")
            record = await action(tenant.name, query.task_id)
            submit = span_context_of(record.traceparent)
            if submit is not None:
                span.add_link(submit)
            span.set_attribute(ta.TASK_STATE, record.state.name)
            return to_status(record)
        except Exception as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()
