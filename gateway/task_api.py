"""The async task RPCs of the Gateway: thin conversions over ``gateway.task_runner``.

``SubmitTask`` authenticates and validates exactly as ``Generate`` (the
servicer's ``prepare``), so a bad request fails at once; then the runner stores
a QUEUED record and runs the generation in the background through the
servicer's ``run`` (result cache included), collecting the choices into the
result. The id is ``task-<32 hex>``; the generation's request id is the
caller's ``request_id`` or the task id.

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

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.choices import RequestTimer
from gateway.collector import ChoiceCollector
from gateway.task_runner import TaskRunner
from gateway.task_store import TaskRecord
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
    """SubmitTask, GetTask and CancelTask of one ``GatewayServicer``.

    Args:
        servicer: the gateway servicer (its tenants, ``prepare``, ``run``, spans).
        runner: the task runner over its store.
    """

    def __init__(self, servicer, runner: TaskRunner):
        self.servicer = servicer
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
        gw = self.servicer
        timer = RequestTimer()
        tenant = gw.tenants.authenticate(context.invocation_metadata())
        task_id = f"task-{uuid.uuid4().hex}"
        span = _tracer.start_span(ta.SPAN_SUBMIT_TASK, context=context_from_grpc(context), kind=trace.SpanKind.SERVER,
                                  attributes={ta.TASK_ID: task_id, ta.TENANT: tenant.name})
        try:
            if not request.request_id:
                request.request_id = task_id
            rm = gw.start_metrics(request, tenant, timer)
            try:
                prepared = gw.prepare(request, tenant, rm)
            except BaseException as exc:
                rm.end(time.monotonic(), exc)
                raise
            span.set_attribute(ta.REQUEST_ID, prepared.request_id)
            record = TaskRecord(task_id, tenant.name, request_id=prepared.request_id, created_at=time.time(),
                                traceparent=traceparent_of(span))
            parent = trace.set_span_in_context(span)

            async def work(mark_running) -> bytes:
                run_span = gw.request_span(request, parent, trace.SpanKind.INTERNAL, stream=False)
                run_span.set_attribute(ta.TASK_ID, task_id)
                collector = ChoiceCollector()
                error = None
                try:
                    gw.describe(run_span, prepared)
                    async for msg in gw.run(prepared, run_span, timer, on_assigned=mark_running):
                        collector.feed(msg)
                    return gateway_pb2.TaskStatus(choices=collector.choices()).SerializeToString()
                except BaseException as exc:  # cancelled too: the span says so
                    record_error(run_span, exc)
                    error = exc
                    raise
                finally:
                    rm.end(time.monotonic(), error)
                    gw.finish(prepared)
                    run_span.end()

            try:
                await self.runner.submit(record, work)
            except BaseException as exc:
                rm.end(time.monotonic(), exc)
                gw.finish(prepared)
                raise
            span.set_attribute(ta.TASK_STATE, record.state.name)
            return gateway_pb2.TaskHandle(task_id=task_id, state=int(record.state))
        except Exception as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    async def get(self, query: gateway_pb2.TaskQuery, context: grpc.aio.ServicerContext) -> gateway_pb2.TaskStatus:
        """GetTask. Raises NotFound (unknown, expired or another tenant's), InvalidArgument (empty id)."""
        return await self._answer(ta.SPAN_GET_TASK, query, context, self.runner.get)

    async def cancel(self, query: gateway_pb2.TaskQuery,
                     context: grpc.aio.ServicerContext) -> gateway_pb2.TaskStatus:
        """CancelTask: cancels an unfinished task (its executor call too). Raises as ``get``."""
        return await self._answer(ta.SPAN_CANCEL_TASK, query, context, self.runner.cancel)

    async def _answer(self, name: str, query: gateway_pb2.TaskQuery, context, action) -> gateway_pb2.TaskStatus:
        """One GetTask/CancelTask call: its span (linked to the submit span) around ``action``."""
        tenant = self.servicer.tenants.authenticate(context.invocation_metadata())
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
