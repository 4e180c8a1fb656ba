"""The gateway core's view of the mesh: the three calls it makes and their plain data.

``MeshClient`` is what the gateway core (``gateway.mesh_run.MeshRunner``) needs from
the scheduler and the executors; ``gateway.mesh_client.GrpcMeshClient`` implements it
over gRPC (the only place with their stubs and protobuf messages). Every call
raises ``meshserve.errors.MeshError`` subclasses, never a transport error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence

from opentelemetry import trace

from gateway.events import FinishReason, Queued, TokenLogprob
from meshserve.errors import Unavailable
from meshserve.sampling import SamplingParams


class RefusedByMesh(Unavailable):
    """The scheduler or an executor refused the gateway's own call (PERMISSION_DENIED or
    UNAUTHENTICATED): the gateway's certificate, a tenant the scheduler's tenants file
    does not list, a lease the executor does not accept. The gateway authenticated the
    caller and the scheduler signed the lease, so the fault is the mesh's, never the
    caller's: callers get UNAVAILABLE naming the service's reason (a task is retried).
    The service refused before granting anything: an ``Admit`` refused so holds no lease.
    """


@dataclass(frozen=True, slots=True)
class Admission:
    """What the scheduler is asked to admit.

    Attributes:
        request_id / tenant / priority: the request's.
        num_prompt_tokens: prompt length (tokens).
        max_tokens / n: from the sampling parameters.
        model: the model id.
        block_hashes: the prompt's routing chain hashes (16 bytes per full block).
        hash_block_size: tokens per hashed block; 0: no hashes sent (no prefix-aware routing).
        lease_id: the id the lease gets when granted (32 lowercase hex digits: a uuid4's), so
            that a caller that gives up before reading the assignment can still release it;
            "": the scheduler picks one.
    """

    request_id: str
    tenant: str
    priority: int
    num_prompt_tokens: int
    max_tokens: int
    model: str
    n: int
    block_hashes: tuple[bytes, ...] = ()
    hash_block_size: int = 0
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class Assignment:
    """The scheduler's answer: where to run, under which lease.

    Attributes:
        executor_id / address: the executor and its gRPC address.
        lease_id: the lease to present to the executor and to release.
        queue_s: the time the request waited in the scheduler's queue (seconds).
        lease: the scheduler's signed lease, passed to Execute (``meshserve.lease_token``).
        lease_ttl_s: seconds the lease lives unless renewed (0: it never expires).
        tenant: the tenant it was admitted for (Execute names it).
    """

    executor_id: str
    address: str
    lease_id: str
    queue_s: float
    lease: bytes = b""
    lease_ttl_s: float = 0.0
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class ExecutorOutput:
    """One message of an executor's token stream (choices interleave).

    Attributes:
        index: the choice, in [0, n).
        token_ids: newly sampled token ids.
        finish_reason: set on the choice's last message.
        num_cached_tokens: prompt tokens reused from a cache (reported with the first token).
        num_kvstore_tokens: of those, fetched from the kvstore.
        logprobs: one entry per token id, when asked.
        prompt_logprobs: prompt positions' logprobs (choice 0, when asked).
    """

    index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    num_kvstore_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class MeshClient(Protocol):
    """The scheduler's Admit/Release and the executors' Execute, in plain data.

    ``span`` is the request's span: each call carries its trace context.
    """

    def admit(self, admission: Admission, span: trace.Span) -> AsyncIterator[Queued | Assignment]:
        """Queue updates, then (normally last) one ``Assignment``.

        Raises:
            RefusedByMesh: the scheduler refused the gateway itself (its certificate, or a
                tenant its tenants file does not list).
            MeshError: the scheduler's error, with its code (quota, overload, no executor).
        """

    def execute(self, assignment: Assignment, request_id: str, prompt_token_ids: Sequence[int],
                params: SamplingParams, priority: int, span: trace.Span,
                cache_salt: str = "") -> AsyncIterator[ExecutorOutput]:
        """The executor's outputs for the request; closing the iterator early cancels
        the call (the engine aborts the request and frees its blocks). ``cache_salt``:
        the request's own salt ("": none), which the executor combines with the lease's
        tenant (``meshserve.block_hash.cache_salt``).

        Raises:
            RefusedByMesh: the executor refused the lease or the gateway's certificate.
            MeshError: the executor's error, with its code.
        """

    async def renew(self, lease_id: str, span: trace.Span) -> None:
        """Extends the lease (Scheduler.RenewLease); called while the request streams,
        only for an ``Assignment`` with ``lease_ttl_s`` > 0.

        Raises:
            MeshError: the scheduler's error (NOT_FOUND: the lease is gone).
        """

    async def release(self, lease_id: str, num_generated_tokens: int | None, finished: bool,
                      span: trace.Span) -> None:
        """Ends the lease (``lease_id``: an ``Assignment``'s, or the id an ``Admission``
        proposed, when the caller gave up before reading its assignment; an id that is no
        lease is a no-op). ``num_generated_tokens`` (all choices together; None when no
        executor answered) is charged to the tenant's tokens_per_min however the request
        ended; with ``finished`` (every choice finished) it also teaches the scheduler's
        predictor. Never raises: a failure is logged, and a caller cancelled meanwhile
        still waits for the call to complete (at most its 5 s timeout)."""

    async def close(self) -> None:
        """Closes its connections."""
