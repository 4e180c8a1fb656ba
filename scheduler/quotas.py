"""Tenant KV quotas: the blocks each tenant's leases hold across all executors.

The admission core's lease table (``scheduler.lease_table``) is the only writer:
it ``reserve``s a lease's blocks when the core assigns the lease, ``recharge``s
the lease when its executor reports the blocks the lease's requests really hold
(decode growth, prefix sharing), and ``free``s the lease's current charge when
the lease is released. Until the first report a lease
holds the blocks admission counted for it
(``n * ceil((num_prompt_tokens + 1) / block_size)``, ``scheduler.placement``).

Invariant: ``held(t)`` == the sum of the blocks of tenant ``t``'s live leases.
"""

from __future__ import annotations

from typing import Mapping


class TenantQuotas:
    """Per-tenant block caps and holdings.

    Args:
        quotas: tenant name → cap in blocks; a tenant not listed (or mapped to
            None) has no cap.
    """

    def __init__(self, quotas: Mapping[str, int | None] | None = None):
        self._quotas = {name: q for name, q in (quotas or {}).items() if q is not None}
        self._held: dict[str, int] = {}

    def limit(self, tenant: str) -> int | None:
        """The tenant's cap in blocks, or None."""
        return self._quotas.get(tenant)

    def held(self, tenant: str) -> int:
        """Blocks the tenant's live leases hold."""
        return self._held.get(tenant, 0)

    def allows(self, tenant: str, num_blocks: int) -> bool:
        """True if the tenant may take ``num_blocks`` more blocks now."""
        cap = self.limit(tenant)
        return cap is None or self.held(tenant) + num_blocks <= cap

    def reserve(self, tenant: str, num_blocks: int) -> None:
        """Charges a new lease's blocks to the tenant."""
        self._held[tenant] = self.held(tenant) + num_blocks

    def recharge(self, tenant: str, old_blocks: int, new_blocks: int) -> None:
        """Replaces a live lease's charge of ``old_blocks`` by ``new_blocks`` (blocks)."""
        self.free(tenant, old_blocks)
        if new_blocks:
            self.reserve(tenant, new_blocks)

    def free(self, tenant: str, num_blocks: int) -> None:
        """Returns an ended lease's blocks."""
        left = self.held(tenant) - num_blocks
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def snapshot(self) -> dict[str, int]:
        """Tenant → blocks held (tenants holding none are left out)."""
        return dict(self._held)


def quota_max_tokens(quota: int | None, n: int, block_size: int, num_prompt_tokens: int) -> int:
    """The most tokens each of a request's ``n`` choices may generate within its
    tenant's quota of ``quota`` blocks: the largest ``m`` with
    ``n × ceil((num_prompt_tokens + m) / block_size) <= quota`` (each choice counted
    with the whole prompt, as admission counts it); 0 without a quota, at least 1
    with one (0 would mean no bound). Admission takes a request whose
    ``n × ceil((prompt + 1) / block_size)`` blocks, capped at the executor's whole
    cache, fit the quota; without that cap the formula gives it at least 1, and a
    request the cap let in (its choices share the prompt's blocks in the prefix
    cache) gets 1.
    """
    if quota is None:
        return 0
    return max(1, (quota // max(1, n)) * block_size - num_prompt_tokens)
