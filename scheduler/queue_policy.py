"""The admission queue's order: FCFS, priority classes, or shortest-job-first with aging.

A policy only *orders* the queued requests at a given time; the admission core
(``scheduler.admission``) decides what fits where. Orders, as sort keys (smaller
first; ``seq`` is the submission counter, which breaks every remaining tie):

* ``fcfs``: ``(arrival, seq)`` — pure arrival order, priority ignored.
* ``priority``: ``(-priority, arrival, seq)`` — higher priority class first,
  FCFS inside a class.
* ``sjf``: ``(-priority, effective_cost, arrival, seq)`` — higher class first;
  inside a class, the smallest effective cost first, where

      cost           = num_prompt_tokens + n * predicted_output_tokens   (tokens)
      effective_cost = cost * max(0, 1 - wait / max_queue_wait_s)

  and ``wait = now - arrival``. The effective cost falls linearly to 0 as the
  request's wait reaches the aging bound; from then on it ties at 0 with every
  other overdue request of its class, so overdue requests go first, in arrival
  order. A request therefore never waits behind a *shorter* request of its class
  for longer than the bound (it may still wait for an executor with room, and
  for higher classes: priority classes are strict).

The cost is fixed when the request is queued (the predictor's answer then), so
the order only changes through waiting time; the one exception is a request
queued while the predictor had no data for it (its answer was the prior): the
admission core asks again at each dispatch until a learned level answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

POLICIES = ("fcfs", "priority", "sjf")


class Queued(Protocol):
    """What a policy reads of a queued request."""

    priority: int
    arrival: float
    seq: int
    cost: float


@dataclass(frozen=True)
class QueuePolicy:
    """Orders queued requests.

    Attributes:
        name: ``fcfs``, ``priority`` or ``sjf`` (see the module docstring).
        max_queue_wait_s: the aging bound of ``sjf`` (seconds, > 0).

    Raises:
        ValueError: an unknown name or a bound <= 0.
    """

    name: str = "fcfs"
    max_queue_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown queue policy {self.name!r} (choose from {', '.join(POLICIES)})")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0 seconds, got {self.max_queue_wait_s}")

    def effective_cost(self, req: Queued, now: float) -> float:
        """``cost * max(0, 1 - wait / max_queue_wait_s)`` (tokens)."""
        wait = max(0.0, now - req.arrival)
        return req.cost * max(0.0, 1.0 - wait / self.max_queue_wait_s)

    def key(self, req: Queued, now: float) -> tuple:
        """Sort key of ``req`` at time ``now`` (smaller goes first)."""
        if self.name == "fcfs":
            return (req.arrival, req.seq)
        if self.name == "priority":
            return (-req.priority, req.arrival, req.seq)
        return (-req.priority, self.effective_cost(req, now), req.arrival, req.seq)

    def order(self, queued: Sequence[Queued], now: float) -> list:
        """The queued requests in dispatch order at time ``now``."""
        return sorted(queued, key=lambda r: self.key(r, now))
