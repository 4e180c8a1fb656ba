"""The scheduler's pure core: the FCFS admission queue and dispatch to executors.

No gRPC here: the servicer calls ``submit``, ``dispatch``, ``release`` and the
registry methods, and turns the results into stream events. Dispatch is strict
FCFS: the head of the queue goes to the executor serving its model with the most
available KV blocks (reported free blocks minus blocks promised to leases the
executor has not reported yet), if one can hold its prompt; otherwise the whole
queue waits, so a large request is never starved by smaller ones behind it.

Blocks of a request: ``ceil((num_prompt_tokens + 1) / block_size)`` per choice,
times ``n`` choices (each choice is its own engine request with its own copy of
the prompt: sharing happens only through the prefix cache, so it is not
assumed), capped at the executor's whole cache (the engine runs the choices in
turn when they do not fit at once).
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from meshserve.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from scheduler.registry import ExecutorRegistry, ExecutorState, Lease


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission settings.

    Attributes:
        max_queue_len: requests the queue holds before RESOURCE_EXHAUSTED.
        pending_timeout_s: seconds a lease counts as pending before the executor
            reports it (see ``scheduler.registry``).
        retry_after_s: retry delay suggested with RESOURCE_EXHAUSTED (seconds).
    """

    max_queue_len: int = 4096
    pending_timeout_s: float = 10.0
    retry_after_s: float = 1.0


@dataclass
class AdmissionRequest:
    """A request waiting for an executor (from ``AdmitRequest``)."""

    request_id: str
    tenant: str
    priority: int
    num_prompt_tokens: int
    max_tokens: int
    model: str = ""
    arrival: float = 0.0
    n: int = 1  # choices (sampling.n)


class AdmissionCore:
    """FCFS admission queue over an ``ExecutorRegistry``."""

    def __init__(self, config: SchedulerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or SchedulerConfig()
        self.registry = ExecutorRegistry()
        self._clock = clock
        self._queue: OrderedDict[str, AdmissionRequest] = OrderedDict()
        self._leases: dict[str, Lease] = {}
        self._dispatch_times: deque[float] = deque(maxlen=64)

    # -- queue -----------------------------------------------------------------
    def _executors_for(self, model: str) -> list[ExecutorState]:
        return [e for e in self.registry if not model or e.model == model]

    def submit(self, req: AdmissionRequest) -> None:
        """Queues a request.

        Raises:
            Unavailable: no executor serves its model.
            InvalidArgument: no executor could ever hold it (prompt longer than
                max_model_len or than a whole KV cache).
            ResourceExhausted: the queue is full.
            AlreadyExists: a request with the same id is queued or holds a lease.
        """
        if req.request_id in self._queue or any(lease.request_id == req.request_id for lease in self._leases.values()):
            raise AlreadyExists(f"request_id {req.request_id!r} is already queued or running")
        executors = self._executors_for(req.model)
        if not executors:
            what = f"model {req.model!r}" if req.model else "any model"
            raise Unavailable(f"no executor is serving {what}")
        if not any(self._fits_ever(e, req) for e in executors):
            limit = max(min(e.max_model_len, e.num_blocks * e.block_size) for e in executors)
            raise InvalidArgument(
                f"prompt has {req.num_prompt_tokens} tokens; the largest executor holds "
                f"{limit - 1} prompt tokens (max_model_len and KV cache size)"
            )
        if len(self._queue) >= self.config.max_queue_len:
            raise ResourceExhausted(
                f"admission queue is full ({self.config.max_queue_len} requests)", self.config.retry_after_s
            )
        req.arrival = req.arrival or self._clock()
        self._queue[req.request_id] = req

    @staticmethod
    def _blocks_per_choice(e: ExecutorState, req: AdmissionRequest) -> int:
        return math.ceil((req.num_prompt_tokens + 1) / e.block_size)

    def _blocks_needed(self, e: ExecutorState, req: AdmissionRequest) -> int:
        """n choices' blocks (see the module doc), at most the executor's whole cache."""
        return min(max(1, req.n) * self._blocks_per_choice(e, req), e.num_blocks)

    def _fits_ever(self, e: ExecutorState, req: AdmissionRequest) -> bool:
        return req.num_prompt_tokens + 1 <= e.max_model_len and self._blocks_per_choice(e, req) <= e.num_blocks

    def cancel(self, request_id: str) -> bool:
        """Removes a queued request (its caller went away)."""
        return self._queue.pop(request_id, None) is not None

    def position(self, request_id: str) -> int:
        """0-based queue position, or -1 if not queued."""
        for i, rid in enumerate(self._queue):
            if rid == request_id:
                return i
        return -1

    def estimated_wait_s(self, position: int) -> float:
        """Wait estimate: position+1 times the recent mean gap between dispatches."""
        if len(self._dispatch_times) < 2:
            return 0.0
        span = self._dispatch_times[-1] - self._dispatch_times[0]
        return (position + 1) * span / (len(self._dispatch_times) - 1)

    def __len__(self) -> int:
        return len(self._queue)

    # -- dispatch --------------------------------------------------------------
    def _pick(self, req: AdmissionRequest, now: float) -> ExecutorState | None:
        best, best_free = None, -1
        for e in self._executors_for(req.model):
            free = e.available_blocks(now, self.config.pending_timeout_s)
            if self._fits_ever(e, req) and free >= self._blocks_needed(e, req) and free > best_free:
                best, best_free = e, free
        return best

    def dispatch(self) -> list[tuple[AdmissionRequest, Lease]]:
        """Assigns queued requests in FCFS order while the head fits somewhere."""
        now = self._clock()
        assigned: list[tuple[AdmissionRequest, Lease]] = []
        while self._queue:
            req = next(iter(self._queue.values()))
            executor = self._pick(req, now)
            if executor is None:
                break
            del self._queue[req.request_id]
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                request_id=req.request_id,
                executor_id=executor.executor_id,
                num_blocks=self._blocks_needed(executor, req),
                tenant=req.tenant,
                assigned_at=now,
            )
            executor.leases[lease.lease_id] = lease
            self._leases[lease.lease_id] = lease
            self._dispatch_times.append(now)
            assigned.append((req, lease))
        return assigned

    def release(self, lease_id: str) -> bool:
        """Ends a lease (idempotent): the request finished or was cancelled."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        executor = self.registry.get(lease.executor_id)
        if executor is not None:
            executor.leases.pop(lease_id, None)
        return True

    def remove_executor(self, executor_id: str) -> list[Lease]:
        """Drops an executor and voids its leases."""
        leases = self.registry.remove(executor_id)
        for lease in leases:
            self._leases.pop(lease.lease_id, None)
        return leases

    def queued(self) -> list[AdmissionRequest]:
        """Queued requests in queue order."""
        return list(self._queue.values())

    def num_leases(self) -> int:
        """Leases currently held."""
        return len(self._leases)
