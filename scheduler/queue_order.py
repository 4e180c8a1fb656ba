"""Queue positions and estimated waits from one sort per queue change.

Every waiting Admit call asks for its position and estimated wait each
``QUEUE_UPDATE_INTERVAL_S`` (0.5 s, ``scheduler.server``). Sorting the queue for
each answer made one polling round of n waiters cost n × n log n (4,096 waiters:
about 9 s of CPU with fcfs, 27 s with sjf, per 0.5 s round). Instead the admission
queue (``scheduler.admission_queue``) keeps a ``QueueOrder``: the queue in dispatch
order, each request's index in it and the running sum of the requests' costs,
rebuilt only when the queue changed since (the admission queue bumps a version on
every insertion, removal or cost change) or, for ``sjf``, when it is older than
``max_age_s``:

* ``fcfs`` and ``priority`` orders do not depend on time: a position or wait is
  exactly that of a fresh sort now.
* the ``sjf`` order does (aging lowers the effective cost of waiting requests),
  so a snapshot is reused for at most ``max_age_s`` of the core's clock (default
  0.5 s, the polling interval; a clock that went back rebuilds it): a reported
  position or wait is that of the order at most that long ago, never of another
  queue. Dispatch always sorts afresh; only the reports may lag.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Protocol

from scheduler.queue_policy import QueuePolicy

ORDER_MAX_AGE_S = 0.5  # the sjf snapshot's largest age (seconds): the Admit stream's polling interval


class Ordered(Protocol):
    """What the order reads of a queued request (``scheduler.admission_queue.AdmissionRequest``)."""

    request_id: str
    priority: int
    arrival: float
    seq: int
    cost: float


@dataclass(frozen=True)
class OrderSnapshot:
    """The queue in dispatch order at ``at`` (clock seconds), for queue ``version``.

    Attributes:
        order: the requests, first to go first.
        index: request id → its 0-based position in ``order``.
        cost_upto: ``cost_upto[i]`` = the summed cost (tokens) of ``order[:i]``,
            added in order (equal to ``sum`` over that slice).
    """

    version: int
    at: float
    order: tuple
    index: dict[str, int]
    cost_upto: tuple[float, ...]


class QueueOrder:
    """Caches the dispatch order of a queue (module docstring).

    Args:
        policy: the queue policy that orders it.
        max_age_s: how long an ``sjf`` snapshot is reused (seconds, >= 0).

    Raises:
        ValueError: ``max_age_s`` < 0.
    """

    def __init__(self, policy: QueuePolicy, max_age_s: float = ORDER_MAX_AGE_S):
        if not max_age_s >= 0:
            raise ValueError(f"max_age_s must be >= 0 seconds, got {max_age_s}")
        self.policy = policy
        self.max_age_s = max_age_s
        self._snapshot: OrderSnapshot | None = None

    def snapshot(self, queued: Iterable[Ordered], version: int, now: float) -> OrderSnapshot:
        """The order of ``queued`` (the queue at ``version``) at ``now`` or, for sjf, at most
        ``max_age_s`` before it; sorts only when the cached one does not answer."""
        snap = self._snapshot
        if snap is not None and snap.version == version and self._fresh(snap, now):
            return snap
        order = tuple(self.policy.order(list(queued), now))
        snap = OrderSnapshot(version, now, order, {r.request_id: i for i, r in enumerate(order)},
                             tuple(accumulate((r.cost for r in order), initial=0)))
        self._snapshot = snap
        return snap

    def _fresh(self, snap: OrderSnapshot, now: float) -> bool:
        if self.policy.name != "sjf":
            return True  # fcfs and priority keys do not change with time
        return snap.at <= now < snap.at + self.max_age_s
