"""Who may call what: every RPC of the mesh → the roles allowed to call it.

A caller's role is the ``spiffe://meshserve/<role>`` URI SAN of its verified
client certificate (``meshserve.certs``); ``meshserve.authz`` checks this table
on every call of a TLS server. An RPC missing from the table is refused to
everyone (fail closed); a test proves every RPC of the protos is here.

Why each entry (``docs/security.md`` has the same table for operators):

- ``Gateway/*``: the public API. Any caller, with or without a client
  certificate; the API key in the call's metadata decides the tenant.
- ``Scheduler.Admit`` / ``Release``: the gateway asks for an executor and ends
  the lease. An executor or a client that could admit would choose its tenant.
- ``Scheduler.Connect``: only an executor registers (else a rogue process
  receives every tenant's prompts).
- ``Executor.Execute``: only the gateway, after admission.
- ``KVStore.Lookup`` / ``Get`` / ``Put``: only executors read and write KV blocks
  (the blocks hold prompts, and a forged block corrupts other tenants' answers).
- ``KVStore.WatchPlacements``: the scheduler follows where blocks are, for
  prefix-aware routing (block hashes only, no payload).
- ``Executor.Stats`` / ``KVStore.Stats``: counters for operators (the client
  role) and the services that watch them.
- ``grpc.health.v1.Health``: open (orchestrators, load balancers, ``meshserve
  up``); on an internal port the handshake has already verified the peer.
"""

from __future__ import annotations

from typing import Mapping

PUBLIC = frozenset({"*"})  # any caller, even without a client certificate

GATEWAY, SCHEDULER, EXECUTOR, KVSTORE, CLIENT = "gateway", "scheduler", "executor", "kvstore", "client"
ALL_ROLES = frozenset({GATEWAY, SCHEDULER, EXECUTOR, KVSTORE, CLIENT})

ROLE_TABLE: Mapping[str, frozenset[str]] = {
    "/meshserve.v1.Gateway/Generate": PUBLIC,
    "/meshserve.v1.Gateway/SubmitTask": PUBLIC,
    "/meshserve.v1.Gateway/GetTask": PUBLIC,
    "/meshserve.v1.Gateway/CancelTask": PUBLIC,
    "/meshserve.v1.Gateway/ListModels": PUBLIC,
    "/meshserve.v1.Scheduler/Admit": frozenset({GATEWAY}),
    "/meshserve.v1.Scheduler/Release": frozenset({GATEWAY}),
    "/meshserve.v1.Scheduler/RenewLease": frozenset({GATEWAY}),
    "/meshserve.v1.Scheduler/Connect": frozenset({EXECUTOR}),
    "/meshserve.v1.Executor/Execute": frozenset({GATEWAY}),
    "/meshserve.v1.Executor/Stats": frozenset({CLIENT, GATEWAY, SCHEDULER}),
    "/meshserve.v1.KVStore/Lookup": frozenset({EXECUTOR}),
    "/meshserve.v1.KVStore/Get": frozenset({EXECUTOR}),
    "/meshserve.v1.KVStore/Put": frozenset({EXECUTOR}),
    "/meshserve.v1.KVStore/Stats": frozenset({CLIENT, SCHEDULER, EXECUTOR}),
    "/meshserve.v1.KVStore/WatchPlacements": frozenset({SCHEDULER}),
    "/grpc.health.v1.Health/Check": PUBLIC,
    "/grpc.health.v1.Health/Watch": PUBLIC,
    "/grpc.health.v1.Health/List": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": PUBLIC,
}


def allowed_roles(method: str) -> frozenset[str]:
    """The roles that may call ``method`` (``/package.Service/Method``); ``PUBLIC``
    for anyone; empty for a method not in the table."""
    return ROLE_TABLE.get(method, frozenset())
