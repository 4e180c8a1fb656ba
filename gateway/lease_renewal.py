"""Keeps a lease alive while its request streams: ``RenewLease`` every quarter lifetime,
unless an executor output came since the last one.

The scheduler releases a lease that nobody renews for ``lease_ttl_s`` once its
executor no longer runs it (``scheduler.lease_table``), so a gateway that dies
gives its leases back within a bounded time; a live gateway renews each lease
it holds from the assignment until it releases it. Renewing four times per
lifetime lets three renewals in a row fail (a scheduler briefly unreachable)
before the lease can expire.

An output from the executor means its Execute call is open there, so the
executor lists the lease in its reports (at least every second), and a listed
lease is renewed by the listing itself. A tick that follows an output is
skipped: a streaming request costs no renewal call (measured at 32 concurrent
requests on one core: the renewals were ~30% of the gateway's busy time,
``reports/vllm-cpu/`` runs 24-25). When outputs stop (a request waiting in the
executor, a wedged executor) the next tick renews again, within two quarters of
the lifetime, while the last listing still holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

from opentelemetry import trace

from gateway.mesh import Assignment, MeshClient
from meshserve.errors import MeshError, NotFound

log = logging.getLogger(__name__)

RENEWALS_PER_TTL = 4


class LeaseActivity:
    """Whether an executor output arrived since the renewal loop last looked.

    ``touch`` is called for every output (cheap: one attribute write); the loop's
    ``take`` reads and clears it.
    """

    def __init__(self) -> None:
        self._active = False

    def touch(self) -> None:
        """An output of the lease's request arrived."""
        self._active = True

    def take(self) -> bool:
        """True when an output arrived since the last ``take``; clears it."""
        active, self._active = self._active, False
        return active


@contextlib.asynccontextmanager
async def renewing(mesh: MeshClient, assignment: Assignment, span: trace.Span,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
    """Renews ``assignment``'s lease every ``lease_ttl_s / 4`` seconds (``sleep`` waits
    them) while the block runs, skipping a tick after an output (nothing when
    ``lease_ttl_s`` is 0: a lease that never expires). Yields the ``LeaseActivity`` to
    ``touch`` for each executor output."""
    activity = LeaseActivity()
    if assignment.lease_ttl_s <= 0:
        yield activity
        return
    task = asyncio.create_task(_renew_loop(mesh, assignment, span, activity, sleep))
    try:
        yield activity
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _renew_loop(mesh: MeshClient, assignment: Assignment, span: trace.Span, activity: LeaseActivity,
                      sleep: Callable[[float], Awaitable[None]]) -> None:
    interval = assignment.lease_ttl_s / RENEWALS_PER_TTL
    while True:
        await sleep(interval)
        if activity.take():  # streaming: the executor's reports list the lease, which renews it
            continue
        try:
            await mesh.renew(assignment.lease_id, span)
        except NotFound:
            log.warning("lease %s is gone at the scheduler; no more renewals", assignment.lease_id)
            return
        except MeshError as exc:  # scheduler unreachable for now: the next renewal may pass
            log.warning("renewal of lease %s failed: %s", assignment.lease_id, exc)
