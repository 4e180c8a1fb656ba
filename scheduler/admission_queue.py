"""The admission queue: the requests waiting for an executor, and its bounds.

``AdmissionQueue`` keeps the queued ``AdmissionRequest``s by request id, the
prompt tokens they add up to, the lease ids they proposed (``lease_id``) and a
version bumped on every change of its members or their costs, from which
``scheduler.queue_order`` answers positions and estimated waits with one sort
per change. The admission core (``scheduler.admission``) decides what enters
and leaves it; the queue decides nothing but the room.

**Overload.** The queue holds at most ``max_len`` requests and ``max_tokens``
queued prompt tokens (``n * num_prompt_tokens`` each; an empty queue always
takes one request). An arrival that does not fit displaces queued requests of
strictly lower priority (lowest priority first, latest arrival first within it)
if that makes room; otherwise the arrival is refused. The core answers
displaced and refused requests with RESOURCE_EXHAUSTED and a retry delay: the
estimated wait of the queue's tail (at least ``retry_after_s`` when nothing is
measured yet).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from scheduler.queue_order import OrderSnapshot, QueueOrder
from scheduler.queue_policy import QueuePolicy


@dataclass
class AdmissionRequest:
    """A request waiting for an executor (from ``AdmitRequest``).

    ``seq``, ``cost`` and ``predicted_output_tokens`` are set by ``submit``.
    """

    request_id: str
    tenant: str
    priority: int
    num_prompt_tokens: int
    max_tokens: int
    model: str = ""
    arrival: float = 0.0
    n: int = 1  # choices (sampling.n)
    block_hashes: tuple[bytes, ...] = ()  # the prompt's chain hashes (16 bytes each), for routing
    hash_block_size: int = 0  # tokens per block of those hashes
    seq: int = 0
    cost: float = 0.0  # num_prompt_tokens + n * predicted_output_tokens (tokens)
    predicted_output_tokens: int = 0
    prediction_level: str = ""  # the predictor level that answered (``prior``: re-asked at dispatch)
    no_executor_since: float | None = None  # when it last found no executor of its model (scale to zero)
    lease_id: str = ""  # the caller's id for its lease (AdmitRequest.lease_id); "": a uuid4 at dispatch

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it adds to the queue's token bound."""
        return max(1, self.n) * self.num_prompt_tokens


class AdmissionQueue:
    """The queued requests (module docstring).

    Args:
        policy: the dispatch order (``scheduler.queue_policy``).
        max_len: requests it holds.
        max_tokens: queued prompt tokens it holds; None: no bound.
    """

    def __init__(self, policy: QueuePolicy, max_len: int, max_tokens: int | None):
        self.policy = policy
        self.max_len, self.max_tokens = max_len, max_tokens
        self._order = QueueOrder(policy)  # positions and waits: one sort per queue change
        self._version = 0  # bumped on every change of the queue's members or costs
        self._requests: dict[str, AdmissionRequest] = {}
        self._tokens = 0
        self._by_lease_id: dict[str, str] = {}  # a queued request's proposed lease id -> its request id
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[AdmissionRequest]:
        """The queued requests in arrival order."""
        return iter(self._requests.values())

    @property
    def tokens(self) -> int:
        """The queued prompt tokens (``queued_tokens`` summed)."""
        return self._tokens

    def has_lease_id(self, lease_id: str) -> bool:
        """Whether a queued request proposed ``lease_id``."""
        return lease_id in self._by_lease_id

    def changed(self) -> None:
        """Notes that a queued request's cost changed (the sjf order and the waits do)."""
        self._version += 1

    def add(self, req: AdmissionRequest) -> None:
        """Queues ``req`` (its room made: ``victims_for``), numbering it in arrival order."""
        req.seq = next(self._seq)
        self._requests[req.request_id] = req
        self._version += 1
        self._tokens += req.queued_tokens
        if req.lease_id:
            self._by_lease_id[req.lease_id] = req.request_id

    def remove(self, request_id: str) -> AdmissionRequest | None:
        """Removes and returns the queued request, or None when it is not queued."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._version += 1
            self._tokens -= req.queued_tokens
            self._by_lease_id.pop(req.lease_id, None)
        return req

    def withdraw(self, lease_id: str) -> AdmissionRequest | None:
        """Removes and returns the queued request that proposed ``lease_id``, or None."""
        request_id = self._by_lease_id.get(lease_id) if lease_id else None
        return None if request_id is None else self.remove(request_id)

    def _over(self, count: int, tokens: int) -> bool:
        bound = self.max_tokens
        return count > self.max_len or (bound is not None and count > 1 and tokens > bound)

    def victims_for(self, req: AdmissionRequest) -> list[AdmissionRequest] | None:
        """The lower-priority requests whose displacement makes room for ``req`` (none when
        it fits as it is), or None when even that leaves it over the bounds; removes nothing."""
        count, tokens = len(self._requests) + 1, self._tokens + req.queued_tokens
        victims: list[AdmissionRequest] = []
        lower = sorted((q for q in self._requests.values() if q.priority < req.priority),
                       key=lambda q: (q.priority, -q.arrival, -q.seq))
        for victim in lower:
            if not self._over(count, tokens):
                break
            victims.append(victim)
            count, tokens = count - 1, tokens - victim.queued_tokens
        return None if self._over(count, tokens) else victims

    def ordered(self, now: float) -> list[AdmissionRequest]:
        """The queued requests in dispatch order at ``now`` (a fresh sort)."""
        return self.policy.order(list(self._requests.values()), now)

    def snapshot(self, now: float) -> OrderSnapshot:
        """The dispatch order for positions and waits (``scheduler.queue_order``: sjf's at
        most ``ORDER_MAX_AGE_S`` old)."""
        return self._order.snapshot(self._requests.values(), self._version, now)
