"""Keeps a lease alive while its request streams: ``RenewLease`` every quarter lifetime.

The scheduler releases a lease that nobody renews for ``lease_ttl_s`` once its
executor no longer runs it (``scheduler.admission``), so a gateway that dies
gives its leases back within a bounded time; a live gateway renews each lease
it holds from the assignment until it releases it. Renewing four times per
lifetime lets three renewals in a row fail (a scheduler briefly unreachable)
before the lease can expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from opentelemetry import trace

from gateway.mesh import Assignment, MeshClient
from meshserve.errors import MeshError, NotFound

log = logging.getLogger(__name__)

RENEWALS_PER_TTL = 4


@contextlib.asynccontextmanager
async def renewing(mesh: MeshClient, assignment: Assignment, span: trace.Span):
    """Renews ``assignment``'s lease every ``lease_ttl_s / 4`` seconds while the
    block runs (nothing when ``lease_ttl_s`` is 0: a lease that never expires)."""
    if assignment.lease_ttl_s <= 0:
        yield
        return
    task = asyncio.create_task(_renew_loop(mesh, assignment, span))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _renew_loop(mesh: MeshClient, assignment: Assignment, span: trace.Span) -> None:
    interval = assignment.lease_ttl_s / RENEWALS_PER_TTL
    while True:
        await asyncio.sleep(interval)
        try:
            await mesh.renew(assignment.lease_id, span)
        except NotFound:
            log.warning("lease %s is gone at the scheduler; no more renewals", assignment.lease_id)
            return
        except MeshError as exc:  # scheduler unreachable for now: the next renewal may pass
            log.warning("renewal of lease %s failed: %s", assignment.lease_id, exc)
