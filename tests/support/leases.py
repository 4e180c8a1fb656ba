"""Leases signed with a test mesh's own scheduler key, for tests that call an executor's
``Execute`` directly (the executor refuses any call without one)."""

from __future__ import annotations

import time
import uuid

from meshserve.lease_token import LeaseClaims, LeaseSigner, new_nonce


def signed_lease(mesh, executor: int, request_id: str, tenant: str = "default", ttl_s: float = 600.0,
                 num_blocks: int = 1, priority: int = 0) -> bytes:
    """A lease of ``mesh``'s scheduler (a ``LocalMesh``) for executor ``executor`` (its
    index), ``request_id`` and ``tenant``, valid ``ttl_s`` seconds from now."""
    executor_id = mesh.executors[executor][0].servicer.executor_id
    return mesh.scheduler.servicer.signer.sign(LeaseClaims(
        lease_id=uuid.uuid4().hex, request_id=request_id, tenant=tenant, executor_id=executor_id,
        num_blocks=num_blocks, expires_at_unix_s=time.time() + ttl_s, nonce=new_nonce(), priority=priority))


def standalone_lease(service, request_id: str, tenant: str = "default", ttl_s: float = 600.0) -> bytes:
    """A lease for an executor ``service`` started without a scheduler: a fresh signer's
    public key is given to the executor (as a RegisterAck would), then the lease is signed."""
    signer = LeaseSigner()
    service.servicer.leases.set_public_key(signer.public_key)
    return signer.sign(LeaseClaims(
        lease_id=uuid.uuid4().hex, request_id=request_id, tenant=tenant, executor_id=service.servicer.executor_id,
        num_blocks=1, expires_at_unix_s=time.time() + ttl_s, nonce=new_nonce(), priority=0))
