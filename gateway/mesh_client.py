"""``MeshClient`` over gRPC: Scheduler.Admit/Release and Executor.Execute.

The only gateway module besides the adapters that holds stubs and protobuf
messages: it turns the core's plain data (``gateway.mesh``) into requests and
the services' messages back into plain data, carries the request's W3C trace
context in each call's metadata, and re-raises a failed call as the domain error
of the same status code (``meshserve.errors.from_rpc_error``), except a
PERMISSION_DENIED or UNAUTHENTICATED: only the mesh causes those (the gateway
authenticated the caller), so they are ``gateway.mesh.RefusedByMesh``, UNAVAILABLE
to callers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import trace

from gateway.events import Queued
from gateway.mesh import Admission, Assignment, ExecutorOutput, RefusedByMesh
from gateway.proto_convert import finish_reason_from_proto, logprobs_from_proto
from meshserve.errors import MeshError, from_rpc_error
from meshserve.grpc_server import CHANNEL_OPTIONS, TOKEN_STREAM_CHANNEL_OPTIONS, open_channel
from meshserve.sampling import SamplingParams, to_proto
from meshserve.telemetry import outgoing_metadata
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

EXECUTOR_TLS_NAME = "executor"
"""The name an executor's certificate must carry as a DNS SAN (``meshserve certs`` puts
each role's name in its certificate): the gateway checks it whatever address the
executor advertises, since pod IPs and container names are not known when
certificates are made. Its role URI still decides what it may call."""

log = logging.getLogger(__name__)
# The codes that only the mesh can cause (the gateway authenticated the caller and the
# scheduler signed the lease): the scheduler refusing the gateway's certificate or a tenant
# its tenants file lacks, an executor refusing the lease or the gateway's certificate.
_REFUSED_BY_MESH = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def mesh_error(exc: grpc.aio.AioRpcError, service: str) -> MeshError:
    """A failed call to ``service`` (``scheduler``, ``executor e1``) as its domain error:
    ``RefusedByMesh`` (UNAVAILABLE) naming the service's code and reason for a refusal
    of the gateway itself, else ``from_rpc_error``'s error of the same code."""
    if exc.code() in _REFUSED_BY_MESH:
        return RefusedByMesh(f"{service} refused the call ({exc.code().name}): {exc.details()}")
    return from_rpc_error(exc, service)


def output_from_proto(out: executor_pb2.ExecuteResponse) -> ExecutorOutput:
    """One executor message as plain data."""
    return ExecutorOutput(
        index=out.index, token_ids=tuple(out.token_ids), finish_reason=finish_reason_from_proto(out.finish_reason),
        num_cached_tokens=out.num_cached_tokens, num_kvstore_tokens=out.num_kvstore_tokens,
        logprobs=logprobs_from_proto(out.logprobs) if out.logprobs else (),
        prompt_logprobs=logprobs_from_proto(out.prompt_logprobs) if out.prompt_logprobs else ())


def admit_request(a: Admission) -> scheduler_pb2.AdmitRequest:
    """The scheduler's AdmitRequest for an ``Admission``."""
    return scheduler_pb2.AdmitRequest(request_id=a.request_id, tenant=a.tenant, priority=a.priority,
                                      num_prompt_tokens=a.num_prompt_tokens, max_tokens=a.max_tokens, model=a.model,
                                      n=a.n, block_hashes=a.block_hashes, hash_block_size=a.hash_block_size,
                                      lease_id=a.lease_id)


class GrpcMeshClient:
    """The scheduler's and the executors' stubs of one gateway.

    Args:
        scheduler_address: host:port of the scheduler. Executor channels are
            opened on first use, one per address, and kept until ``close``.
        tls: the gateway's certificate (role gateway) for every channel, or plaintext.

    Attributes:
        scheduler_channel: the channel to the scheduler (the readiness probe uses it too).
    """

    def __init__(self, scheduler_address: str, tls: TLSConfig = PLAINTEXT):
        self.tls = tls
        self.scheduler_channel = open_channel(scheduler_address, tls, CHANNEL_OPTIONS)
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self.scheduler_channel)
        self._executors: dict[str, executor_pb2_grpc.ExecutorStub] = {}
        self._channels: list[grpc.aio.Channel] = [self.scheduler_channel]

    def _executor(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        stub = self._executors.get(address)
        if stub is None:
            # an executor advertises a pod IP or a container name, which no certificate made in
            # advance can hold: its certificate is checked against its role's name instead
            channel = open_channel(address, self.tls, TOKEN_STREAM_CHANNEL_OPTIONS, server_name=EXECUTOR_TLS_NAME)
            self._channels.append(channel)
            stub = self._executors[address] = executor_pb2_grpc.ExecutorStub(channel)
        return stub

    async def admit(self, admission: Admission, span: trace.Span) -> AsyncIterator[Queued | Assignment]:
        """Scheduler.Admit (see ``gateway.mesh.MeshClient``); closing it early cancels the call.

        The scheduler's PERMISSION_DENIED or UNAUTHENTICATED (it refuses the gateway's
        certificate, or a tenant its tenants file does not list while the gateway's
        does) is the mesh's failure, not the caller's, whose key the gateway accepted:
        it is raised as ``RefusedByMesh`` (UNAVAILABLE) naming the scheduler's reason.
        Its caller-facing refusals keep their codes (RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
        ALREADY_EXISTS, NOT_FOUND).
        """
        call = self._scheduler.Admit(admit_request(admission), metadata=outgoing_metadata(span))
        try:
            async for event in call:
                if event.WhichOneof("kind") == "queued":
                    yield Queued(event.queued.position, event.queued.estimated_wait_s)
                else:
                    a = event.assignment
                    yield Assignment(a.executor_id, a.address, a.lease_id, a.queue_s, a.lease, a.lease_ttl_s,
                                     admission.tenant)
        except grpc.aio.AioRpcError as exc:
            raise mesh_error(exc, "scheduler") from None
        finally:
            call.cancel()  # no-op when the stream ended

    async def execute(self, assignment: Assignment, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, priority: int, span: trace.Span,
                      cache_salt: str = "") -> AsyncIterator[ExecutorOutput]:
        """Executor.Execute (see ``gateway.mesh.MeshClient``); closing it early cancels the call.

        An executor's PERMISSION_DENIED or UNAUTHENTICATED (a lease it refuses, e.g. one
        that expired on its way on a loaded host, or a certificate it does not accept) is
        the mesh's failure, not the caller's: it is raised as ``RefusedByMesh`` (UNAVAILABLE:
        a task is then retried under a new lease; a caller may retry), naming the
        executor's reason.
        """
        request = executor_pb2.ExecuteRequest(request_id=request_id, lease_id=assignment.lease_id,
                                              prompt_token_ids=prompt_token_ids, priority=priority,
                                              lease=assignment.lease, tenant=assignment.tenant,
                                              cache_salt=cache_salt)
        to_proto(params, request.sampling)
        call = self._executor(assignment.address).Execute(request, metadata=outgoing_metadata(span))
        try:
            async for out in call:
                yield output_from_proto(out)
        except grpc.aio.AioRpcError as exc:
            raise mesh_error(exc, f"executor {assignment.executor_id}") from None
        finally:
            call.cancel()  # no-op when finished; aborts the engine requests otherwise

    async def renew(self, lease_id: str, span: trace.Span) -> None:
        """Scheduler.RenewLease (see ``gateway.mesh.MeshClient``); a refusal of the gateway
        itself is ``RefusedByMesh``, as for ``admit`` (the renewal loop logs it)."""
        try:
            await self._scheduler.RenewLease(scheduler_pb2.RenewLeaseRequest(lease_id=lease_id), timeout=5,
                                             metadata=outgoing_metadata(span))
        except grpc.aio.AioRpcError as exc:
            raise mesh_error(exc, "scheduler") from None

    async def release(self, lease_id: str, num_generated_tokens: int | None, finished: bool,
                      span: trace.Span) -> None:
        """Scheduler.Release (see ``gateway.mesh.MeshClient``); ``span`` is the parent of the
        scheduler's ``scheduler.release``."""
        release = scheduler_pb2.ReleaseRequest(lease_id=lease_id)
        if num_generated_tokens is not None:
            release.num_generated_tokens = num_generated_tokens
            if finished:
                release.num_completion_tokens = num_generated_tokens
        call = asyncio.ensure_future(self._scheduler.Release(release, timeout=5, metadata=outgoing_metadata(span)))
        try:
            try:
                await asyncio.shield(call)
            except asyncio.CancelledError:  # the caller cancelled (again, mid-cleanup): the release lands first,
                await asyncio.wait([call])  # so the gateway's stop never closes the channel under it (5 s at most)
                call.result()
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - shutting down or scheduler gone
            log.warning("release of lease %s failed: %s", lease_id, repr(exc))  # a CancelledError's str is empty

    async def close(self) -> None:
        """Closes the scheduler's and every executor's channel."""
        for channel in self._channels:
            await channel.close()
