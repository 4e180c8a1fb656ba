"""The public Gateway servicer.

``Generate``: authenticate (API key → tenant), build the prompt token ids, validate
the sampling parameters, ask the scheduler for an executor (streaming queue
updates to the caller), stream tokens from the executor through the incremental
detokenizer and the stop-string matcher, then send usage and timings. When a stop
string matches, the caller goes away or anything fails, the executor call is
cancelled (the engine frees the request's blocks) and the lease is released.

With ``n`` choices the executor stream interleaves them; each choice has its own
detokenizer and stop-string matcher (``gateway.choices``), its deltas carry its
index, and it ends with its own ``GenerateResult`` as soon as it is done. The
stream ends after the last choice's result; only then is the executor call
cancelled (a choice cut by a stop string meanwhile runs on, its tokens dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from gateway.choices import Choice, RequestTimer
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.prompt import PromptBuilder
from gateway.readiness import ReadinessProbe
from gateway.tenants import TenantRegistry
from meshserve.block_hash import routing_block_hashes
from meshserve.errors import AlreadyExists, InvalidArgument, Unavailable, from_rpc_error
from meshserve.grpc_server import CHANNEL_OPTIONS, Service
from meshserve.sampling import from_proto, to_proto
from meshserve.telemetry import context_from_grpc, outgoing_metadata, tracer
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the model it fronts.

    Attributes:
        model_id: the model id executors register with.
        max_model_len: longest prompt + output (tokens).
        vocab_size: token ids are in [0, vocab_size).
        revision: the weights' revision (``meshserve.model_files``); with the
            model id it roots the prompt's routing chain hashes, so it must be
            the executors' (both resolve the same model files).
    """

    model_id: str
    max_model_len: int
    vocab_size: int
    revision: str = ""


def _prompt_ids(builder: PromptBuilder, request: gateway_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return builder.from_text(request.prompt)
    if kind == "chat":
        return builder.from_chat([(m.role, m.content) for m in request.chat.messages])
    if kind == "prompt_token_ids":
        return builder.from_token_ids(list(request.prompt_token_ids.ids))
    raise InvalidArgument("one of prompt, chat or prompt_token_ids must be set")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate for one model through the scheduler and its executors."""

    def __init__(self, tokenizer, model: ModelInfo, tenants: TenantRegistry, scheduler_address: str,
                 hash_block_size: int = 16, metrics: GatewayMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics or GatewayMetrics()
        self.hash_block_size = hash_block_size  # 0: send no block hashes (no prefix-aware routing)
        self.prompts = PromptBuilder(tokenizer)
        self.model = model
        self.tenants = tenants
        self._scheduler_channel = grpc.aio.insecure_channel(scheduler_address, options=CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._executors: dict[str, executor_pb2_grpc.ExecutorStub] = {}
        self._channels: list[grpc.aio.Channel] = [self._scheduler_channel]
        self._in_flight: set[str] = set()  # request ids of unfinished Generate calls
        self.readiness: ReadinessProbe | None = None  # set by start_gateway

    def _executor(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        stub = self._executors.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._executors[address] = executor_pb2_grpc.ExecutorStub(channel)
        return stub

    async def close(self) -> None:
        if self.readiness is not None:
            await self.readiness.stop()
        for channel in self._channels:
            await channel.close()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        timer = RequestTimer()
        tenant = self.tenants.authenticate(context.invocation_metadata())
        span = _tracer.start_span("gateway.generate", context=context_from_grpc(context))
        request_id = request.request_id or uuid.uuid4().hex
        owns_id = False
        priority = request.priority if request.HasField("priority") else tenant.default_priority
        rm = self.metrics.start(tenant.name, priority, timer.start)
        error: BaseException | None = None
        try:
            if request_id in self._in_flight:
                raise AlreadyExists(f"request_id {request_id!r} is already in use by an unfinished request")
            self._in_flight.add(request_id)
            owns_id = True
            prompt_ids = _prompt_ids(self.prompts, request)
            params = from_proto(request.sampling, max_model_len=self.model.max_model_len, vocab_size=self.model.vocab_size)
            if len(prompt_ids) + 1 > self.model.max_model_len:
                raise InvalidArgument(
                    f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.model.max_model_len} "
                    "(prompt + at least 1 output token)"
                )
            rm.num_prompt_tokens = len(prompt_ids)  # a valid request's
            span.set_attributes(
                {
                    "meshserve.request_id": request_id,
                    "meshserve.tenant": tenant.name,
                    "meshserve.priority": priority,
                    "gen_ai.request.model": self.model.model_id,
                    "gen_ai.request.max_tokens": params.max_tokens,
                    "gen_ai.request.choice.count": params.n,
                    "gen_ai.usage.input_tokens": len(prompt_ids),
                }
            )
            admit = scheduler_pb2.AdmitRequest(
                request_id=request_id,
                tenant=tenant.name,
                priority=priority,
                num_prompt_tokens=len(prompt_ids),
                max_tokens=params.max_tokens,
                model=self.model.model_id,
                n=params.n,
            )
            if self.hash_block_size > 0:
                admit.block_hashes.extend(routing_block_hashes(prompt_ids, self.hash_block_size, self.model.model_id,
                                                               self.model.revision))
                admit.hash_block_size = self.hash_block_size
            assignment = None
            try:
                async for event in self.scheduler.Admit(admit, metadata=outgoing_metadata(span)):
                    if event.WhichOneof("kind") == "queued":
                        q = event.queued
                        yield gateway_pb2.GenerateResponse(
                            queue=gateway_pb2.QueueUpdate(position=q.position, estimated_wait_s=q.estimated_wait_s)
                        )
                    else:
                        assignment = event.assignment
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, "scheduler") from None
            if assignment is None:
                raise Unavailable("scheduler ended admission without an assignment")
            timer.assigned = time.monotonic()
            rm.assigned(timer.assigned)
            span.set_attribute("meshserve.executor_id", assignment.executor_id)
            finished: dict[str, int] = {}  # completion tokens, once every choice is done
            try:
                async for msg in self._execute(request_id, prompt_ids, params, priority, assignment, timer, span,
                                               finished, rm):
                    yield msg
            finally:
                await self._release(assignment.lease_id, finished.get("completion_tokens"))
        except Exception as exc:
            span.record_exception(exc)
            error = exc
            raise
        except BaseException as exc:  # the caller went away (CancelledError, GeneratorExit)
            error = exc
            raise
        finally:
            rm.end(time.monotonic(), error)
            if owns_id:
                self._in_flight.discard(request_id)
            span.end()

    async def _execute(self, request_id, prompt_ids, params, priority, assignment, timer, span, finished,
                       rm: RequestMetrics):
        exe = executor_pb2.ExecuteRequest(
            request_id=request_id, lease_id=assignment.lease_id, prompt_token_ids=prompt_ids, priority=priority
        )
        to_proto(params, exe.sampling)
        choices = [Choice(i, self.tokenizer, prompt_ids, params.stop) for i in range(params.n)]
        call = self._executor(assignment.address).Execute(exe, metadata=outgoing_metadata(span))
        try:
            async for out in call:
                if not 0 <= out.index < len(choices):
                    raise Unavailable(f"executor {assignment.executor_id} sent choice {out.index} of {params.n}")
                choice = choices[out.index]
                if choice.done:
                    continue  # cut by a stop string; the executor runs it until all choices end
                now = time.monotonic()
                if out.token_ids and not timer.first_token:
                    timer.first_token = now
                    span.add_event("first_token")
                    rm.first_token(now)
                rm.tokens(len(out.token_ids))
                yield gateway_pb2.GenerateResponse(delta=choice.feed(out, now))
                if choice.done:
                    rm.choice_done(choice.num_tokens, choice.first_token, choice.last_token)
                    yield gateway_pb2.GenerateResponse(
                        result=choice.result(request_id, prompt_ids, assignment.executor_id, timer))
                if all(c.done for c in choices):
                    break
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"executor {assignment.executor_id}") from None
        finally:
            call.cancel()  # no-op when finished; aborts the engine requests otherwise
        if not all(c.done for c in choices):
            raise Unavailable(f"executor {assignment.executor_id} ended the stream without finishing")
        finished["completion_tokens"] = sum(c.num_tokens for c in choices)
        span.set_attributes({"gen_ai.usage.output_tokens": sum(c.num_tokens for c in choices),
                             "meshserve.cached_tokens": choices[0].num_cached_tokens})

    async def _release(self, lease_id: str, num_completion_tokens: int | None = None) -> None:
        """Ends the lease; the completion tokens (when every choice finished) teach the scheduler's predictor."""
        release = scheduler_pb2.ReleaseRequest(lease_id=lease_id)
        if num_completion_tokens is not None:
            release.num_completion_tokens = num_completion_tokens
        try:
            await asyncio.shield(self.scheduler.Release(release, timeout=5))
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - shutting down or scheduler gone
            log.warning("release of lease %s failed: %s", lease_id, exc)


async def start_gateway(
    tokenizer, model: ModelInfo, scheduler_address: str, port: int, host: str = "127.0.0.1",
    tenants: TenantRegistry | None = None, hash_block_size: int = 16, metrics_port: int | None = None,
) -> Service:
    """Starts the Gateway service. Its health is SERVING while the scheduler has an
    executor registered (``gateway.readiness``), checked every 0.5 s.

    ``hash_block_size``: tokens per block of the prompt chain hashes sent for
    prefix-aware routing (the executors' ``block_size``; 0: none sent).
    ``metrics_port``: serve Prometheus metrics (``gateway.metrics``) there (0: a
    free port; None: none), as ``service.metrics``.
    """
    service = Service("meshserve.v1.Gateway", port, host)
    servicer = GatewayServicer(tokenizer, model, tenants or TenantRegistry.open(), scheduler_address,
                               hash_block_size)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, service.server)
    service.servicer = servicer  # type: ignore[attr-defined]
    service.serve_metrics(servicer.metrics.registry, metrics_port)
    await service.start()
    servicer.readiness = ReadinessProbe(service, servicer._scheduler_channel)
    await servicer.readiness.check()
    servicer.readiness.start()
    return service
