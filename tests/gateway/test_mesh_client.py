"""``gateway.mesh_client.mesh_error``: a failed call to the scheduler or an executor
as the gateway's domain error. PERMISSION_DENIED and UNAUTHENTICATED, which only the
mesh causes (the gateway authenticated the caller), are ``RefusedByMesh``
(UNAVAILABLE) naming the service's reason; every other code keeps its own."""

from __future__ import annotations

import grpc
import pytest

from gateway.mesh import RefusedByMesh
from gateway.mesh_client import mesh_error
from meshserve.errors import AlreadyExists, InvalidArgument, MeshError, NotFound, ResourceExhausted, Unavailable

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


@pytest.mark.parametrize("code, details, message", [
    (Code.PERMISSION_DENIED, "unknown tenant 'b'",
     "scheduler refused the call (PERMISSION_DENIED): unknown tenant 'b'"),
    (Code.UNAUTHENTICATED, "/meshserve.v1.Scheduler/Admit needs a client certificate naming a meshserve role",
     "scheduler refused the call (UNAUTHENTICATED): /meshserve.v1.Scheduler/Admit needs a client certificate "
     "naming a meshserve role"),
])
def test_a_refusal_of_the_gateway_itself_is_unavailable_naming_the_reason(code, details, message):
    err = mesh_error(rpc_error(code, details), "scheduler")
    assert (type(err), err.code, str(err)) == (RefusedByMesh, Code.UNAVAILABLE, message)
    assert isinstance(err, Unavailable)


@pytest.mark.parametrize("code, cls", [
    (Code.RESOURCE_EXHAUSTED, ResourceExhausted),
    (Code.INVALID_ARGUMENT, InvalidArgument),
    (Code.ALREADY_EXISTS, AlreadyExists),
    (Code.NOT_FOUND, NotFound),
    (Code.UNAVAILABLE, Unavailable),
])
def test_the_services_caller_facing_codes_keep_their_code(code, cls):
    err = mesh_error(rpc_error(code, "why"), "scheduler")
    assert (type(err), err.code, str(err)) == (cls, code, "scheduler: why")


def test_a_resource_exhausted_keeps_its_retry_delay_and_another_code_its_own():
    err = mesh_error(rpc_error(Code.RESOURCE_EXHAUSTED, "queue full", [("retry-after-s", "2.500")]), "scheduler")
    assert err.retry_after_s == 2.5
    err = mesh_error(rpc_error(Code.DEADLINE_EXCEEDED, "late"), "executor e1")
    assert (type(err), err.code, str(err)) == (MeshError, Code.DEADLINE_EXCEEDED, "executor e1: late")
