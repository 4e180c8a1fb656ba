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

import time
import uuid
from contextlib import aclosing

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.collector import ChoiceCollector
from gateway.generation import GatewayCore
from gateway.proto_convert import request_from_proto, task_result
from gateway.request import Prepared, SpanOptions
from gateway.task_runner import MarkRunning, TaskRunner
from gateway.task_store import TaskRecord
from gateway.tenants import TenantRegistry
from meshserve import trace_attributes as ta
from meshserve.errors import InvalidArgument
from meshserve.telemetry import context_from_grpc, record_error, tracer
from meshserve.v1 import gateway_pb2

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
    status.created_at_unix_s, status.started_at_unix_s = record.created_at, record.started_at
    status.finished_at_unix_s = record.finished_at
    if record.error_code:
        status.error.code, status.error.message = record.error_code, record.error_message
    return status


class TaskAPI:
    """SubmitTask, GetTask and CancelTask over a ``GatewayCore``.

    Args:
        core: the gateway core that runs the tasks' generations.
        tenants: API keys → tenants.
        runner: the task runner over its store.
    """

    def __init__(self, core: GatewayCore, tenants: TenantRegistry, runner: TaskRunner):
        self.core = core
        self.tenants = tenants
        self.runner = runner

    async def close(self) -> None:
        """Stops every running task (they end FAILED, UNAVAILABLE) and closes the store."""
        await self.runner.close()
        await self.runner.store.close()

    async def submit(self, request: gateway_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> gateway_pb2.TaskHandle:
        """SubmitTask: validates, stores a QUEUED task, starts its generation.

        Raises:
            Unauthenticated, InvalidArgument, AlreadyExists: as Generate, before anything is stored.
            ResourceExhausted: the memory store is full of unfinished tasks.
            Unavailable: the Redis store cannot be reached.
        """
        received_at = time.monotonic()
        tenant = self.tenants.authenticate(context.invocation_metadata())
        task_id = f"task-{uuid.uuid4().hex}"
        span = _tracer.start_span(ta.SPAN_SUBMIT_TASK, context=context_from_grpc(context), kind=trace.SpanKind.SERVER,
                                  attributes={ta.TASK_ID: task_id, ta.TENANT: tenant.name})
        try:
            prepared = await self.core.prepare_async(request_from_proto(request, default_request_id=task_id), tenant,
                                                     received_at)
            span.set_attribute(ta.REQUEST_ID, prepared.request_id)
            record = TaskRecord(task_id, tenant.name, request_id=prepared.request_id, created_at=time.time(),
                                traceparent=traceparent_of(span))
            options = SpanOptions(parent=trace.set_span_in_context(span), kind=trace.SpanKind.INTERNAL, stream=False,
                                  attributes={ta.TASK_ID: task_id})
            try:
                await self.runner.submit(record, lambda mark_running: self._work(prepared, options, mark_running))
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

    async def _work(self, prepared: Prepared, options: SpanOptions, mark_running: MarkRunning) -> bytes:
        """A task's generation: the core's events collected into the task's result."""
        collector = ChoiceCollector()
        async with aclosing(self.core.run(prepared, options, on_assigned=mark_running)) as events:
            async for event in events:
                collector.feed(event)
        return task_result(collector.choices())

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
