"""The refusals no wait can cure: pure checks of one request at admission.

The admission core (``scheduler.admission``) runs them when a request arrives and,
for a request that waits for an executor to start (scale to zero), once executors
of its model have registered. Each raises the error the caller gets:

* ``tenant_limits``: PERMISSION_DENIED for a tenant the configured tenants do not list;
* ``check_fits``: INVALID_ARGUMENT when no executor could ever hold the request
  (prompt longer than max_model_len or than a whole KV cache);
* ``check_quota_alone``: RESOURCE_EXHAUSTED with no retry delay when the request
  alone needs more KV blocks than its tenant's quota.

``describe`` names what no executor serves, for the UNAVAILABLE messages.
"""

from __future__ import annotations

from typing import Mapping

from meshserve.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from scheduler.admission_queue import AdmissionRequest
from scheduler.placement import blocks_needed, fits_ever
from scheduler.pools import PoolsConfig
from scheduler.registry import ExecutorState
from scheduler.tenant_limits import TenantLimits


def describe(req: AdmissionRequest, pools: PoolsConfig | None) -> str:
    """``model 'x' in pool 'p' or its spill targets``: what no executor serves."""
    what = f"model {req.model!r}" if req.model else "any model"
    if pools is not None:
        what += f" in pool {pools.pool_of(req.priority)!r} or its spill targets"
    return what


def check_fits(req: AdmissionRequest, executors: list[ExecutorState]) -> None:
    """Raises InvalidArgument if none of ``executors`` (non-empty) could ever hold ``req``."""
    if not any(fits_ever(e, req) for e in executors):
        limit = max(min(e.max_model_len, e.num_blocks * e.block_size) for e in executors)
        raise InvalidArgument(
            f"prompt has {req.num_prompt_tokens} tokens; the largest executor holds "
            f"{limit - 1} prompt tokens (max_model_len and KV cache size)"
        )


def check_quota_alone(req: AdmissionRequest, fitting: list[ExecutorState], cap: int | None) -> None:
    """Raises ResourceExhausted (no retry delay) if ``req`` needs more blocks than ``cap``,
    its tenant's quota (None: no quota), on each of the ``fitting`` executors (those that
    could ever hold it; none: no executor yet, checked when one registers)."""
    if not fitting:
        return  # no executor yet (scale to zero): checked when one registers
    executor = min(fitting, key=lambda e: blocks_needed(e, req))
    need = blocks_needed(executor, req)
    if cap is not None and need > cap:
        choices = f"{req.n} choices of " if req.n > 1 else ""
        capped = f", at most the executor's {executor.num_blocks}" if need == executor.num_blocks else ""
        raise ResourceExhausted(
            f"request needs {need} KV blocks ({choices}a prompt of {req.num_prompt_tokens} tokens + 1, in blocks "
            f"of {executor.block_size}{capped}); tenant {req.tenant!r} has a quota of {cap} blocks",
            None,  # it never fits, however long the caller waits: no retry delay
        )


def tenant_limits(limits: Mapping[str, TenantLimits] | None, tenant: str) -> TenantLimits:
    """The tenant's limits in ``limits`` (none when no limits are configured: None).

    Raises:
        PermissionDenied: limits are configured and do not list the tenant.
    """
    if limits is None:
        return TenantLimits()
    found = limits.get(tenant)
    if found is None:
        raise PermissionDenied(f"unknown tenant {tenant!r}")
    return found
