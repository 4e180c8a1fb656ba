"""The role table covers every RPC, and a request that does not parse is
INVALID_ARGUMENT with one log line (no traceback), on plaintext and TLS servers."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvstore.server import start_kvstore
from kvstore.store import KVStore
from meshserve.grpc_server import open_channel
from meshserve.roles import ALL_ROLES, PUBLIC, ROLE_TABLE
from meshserve.tls import PLAINTEXT
from meshserve.v1 import executor_pb2, gateway_pb2, kvstore_pb2, scheduler_pb2
from scheduler.server import start_scheduler
from tests.support.tls import role_tls

PROTO_MODULES = (gateway_pb2, scheduler_pb2, executor_pb2, kvstore_pb2, health_pb2, reflection_pb2)
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, a length far past the end


def rpcs_of_the_protos() -> dict[str, tuple[bool, bool]]:
    """Every RPC of the mesh's services (and grpc.health.v1, server reflection): ``/pkg.Service/Method`` →
    (client streaming, server streaming)."""
    return {f"/{service.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
            for module in PROTO_MODULES for service in module.DESCRIPTOR.services_by_name.values()
            for m in service.methods}


def test_every_rpc_of_the_protos_is_in_the_role_table():
    """Case C35: no RPC is missing (it would be refused to everyone), none is in the
    table that the protos do not define, and every role named exists."""
    rpcs = rpcs_of_the_protos()
    assert sorted(set(rpcs) - set(ROLE_TABLE)) == []
    assert sorted(set(ROLE_TABLE) - set(rpcs)) == []
    assert all(roles is PUBLIC or (roles and roles <= ALL_ROLES) for roles in ROLE_TABLE.values())


def test_the_internal_rpcs_are_for_the_roles_of_the_issue():
    assert ROLE_TABLE["/meshserve.v1.Scheduler/Connect"] == {"executor"}
    assert ROLE_TABLE["/meshserve.v1.Scheduler/Admit"] == ROLE_TABLE["/meshserve.v1.Executor/Execute"] == {"gateway"}
    for method in ("Lookup", "Get", "Put"):
        assert ROLE_TABLE[f"/meshserve.v1.KVStore/{method}"] == {"executor"}
    assert ROLE_TABLE["/meshserve.v1.KVStore/WatchPlacements"] == {"scheduler"}


async def call_raw(channel: grpc.aio.Channel, method: str, client_streaming: bool, server_streaming: bool):
    """Sends ``GARBAGE`` as the request bytes of ``method`` (no serializer)."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    multi = kind[(client_streaming, server_streaming)](method)
    request = iter([GARBAGE]) if client_streaming else GARBAGE
    call = multi(request, timeout=30)
    if server_streaming:
        return [msg async for msg in call]
    return await call


@pytest.fixture(params=["plaintext", "mtls"])
async def services(request):
    """A scheduler and a kvstore, plaintext or mutual TLS; the TLS a caller in each
    role's place uses."""
    secure = request.param == "mtls"
    scheduler = await start_scheduler(0, tls=role_tls("scheduler") if secure else PLAINTEXT)
    kv = await start_kvstore(KVStore(memory_bytes=1 << 20), 0, tls=role_tls("kvstore") if secure else PLAINTEXT)
    yield {"Scheduler": scheduler, "KVStore": kv}, secure
    await scheduler.stop(0)
    await kv.stop(0)


CALLER_ROLE = {"/meshserve.v1.Scheduler/Connect": "executor", "/meshserve.v1.Scheduler/Admit": "gateway",
               "/meshserve.v1.Scheduler/Release": "gateway", "/meshserve.v1.KVStore/WatchPlacements": "scheduler"}


@pytest.mark.parametrize("method", sorted(m for m in rpcs_of_the_protos()
                                          if m.startswith(("/meshserve.v1.Scheduler/", "/meshserve.v1.KVStore/",
                                                           "/grpc.health.v1.Health/Check"))))
async def test_malformed_request_bytes_are_invalid_argument_with_one_log_line(services, method, caplog):
    """Raw bytes that are no protobuf message, sent to every RPC of the scheduler and
    the kvstore (and health) by a caller the role table allows: INVALID_ARGUMENT naming
    the method, one warning line, no traceback; nothing registered or stored."""
    by_name, secure = services
    name = method.split("/")[1].split(".")[-1]
    service = by_name.get(name, by_name["Scheduler"])
    role = CALLER_ROLE.get(method) or sorted(ROLE_TABLE[method] - PUBLIC or {"client"})[0]
    caplog.set_level(logging.WARNING)
    async with open_channel(service.address, role_tls(role) if secure else PLAINTEXT) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call_raw(ch, method, *rpcs_of_the_protos()[method])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"malformed request message for {method}: DecodeError")
    # this call's lines (and any traceback); not other services' background warnings of the session
    records = [r for r in caplog.records if r.levelno >= logging.WARNING and (method in r.getMessage() or r.exc_info)]
    assert [(r.name, r.exc_info) for r in records] == [("meshserve.authz", None)]
    assert "malformed request message" in records[0].getMessage()
    assert list(by_name["Scheduler"].servicer.core.registry) == []
    assert by_name["KVStore"].servicer.store.stats().blocks_stored == 0
