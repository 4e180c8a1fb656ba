"""Callbacks and tenants, without a model (a gateway whose scheduler is unreachable:
its tasks fail UNAVAILABLE and are called back): the signed callback body names the
task's tenant, and a tenant's own ``callback_allow`` narrows the gateway's
``--callback-allow`` for its tasks."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import pytest_asyncio

from gateway.callbacks import CallbackPolicy, CallbackSender, verify
from gateway.server import start_gateway
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, channel, get_task, submit_task, wait_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.http_receiver import Receiver
from tests.support.mesh_harness import wait_for_condition
from tests.support.redis_server import free_port

SECRET = b"callback-secret"
KEY_A, KEY_B = (("x-api-key", "key-a"),), (("x-api-key", "key-b"),)


@pytest_asyncio.fixture
async def served(tmp_path):
    from meshserve.cli.processes import model_info

    try:
        tokenizer, info = await asyncio.to_thread(model_info, "default")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    receiver = await Receiver().start()
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "a"\napi_keys = ["key-a"]\n'
                    f'callback_allow = ["{receiver.url}/hooks/a/"]\n\n'
                    '[[tenants]]\nname = "b"\napi_keys = ["key-b"]\n')
    sender = CallbackSender(CallbackPolicy([receiver.url + "/hooks/"]), SECRET, backoff_s=0.01)
    svc = await start_gateway(tokenizer, info, f"127.0.0.1:{free_port()}", 0, tenants=TenantRegistry.from_file(path),
                              tasks=TaskRunner(MemoryTaskStore()), callbacks=sender)
    ch = channel(svc.address)
    yield gateway_pb2_grpc.GatewayStub(ch), receiver
    await ch.close()
    await svc.stop(0.5)
    await svc.servicer.close()
    await receiver.stop()


def with_callback(url: str) -> gateway_pb2.GenerateRequest:
    request = build_request("Hello", max_tokens=4, temperature=0)
    request.callback_url = url
    return request


async def test_a_tenant_with_its_own_callback_allow_may_name_only_those_urls(served):
    stub, receiver = served
    with pytest.raises(grpc.aio.AioRpcError) as info:  # in the gateway's list, not in tenant a's
        await submit_task(stub, with_callback(receiver.url + "/hooks/b/done"), KEY_A)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "callback_url is not in tenant 'a''s callback_allow list"
    for escape in ("/hooks/a/../b/done", "/hooks/a/%2e%2e/b/done", "/hooks/ab/done"):  # out of a's list
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit_task(stub, with_callback(receiver.url + escape), KEY_A)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, escape
    own = await submit_task(stub, with_callback(receiver.url + "/hooks/a/done"), KEY_A)
    other = await submit_task(stub, with_callback(receiver.url + "/hooks/b/done"), KEY_B)  # b: the gateway's list
    for handle, key in ((own, KEY_A), (other, KEY_B)):
        status = await wait_task(stub, handle.task_id, key, poll_s=0.02, timeout_s=60)
        assert status.state == gateway_pb2.TASK_STATE_FAILED and status.error.code == "UNAVAILABLE"
    await wait_for_condition(lambda: len(receiver.received) == 2, timeout_s=60, what="both callbacks")
    bodies = {}
    for got in receiver.received:
        assert verify(SECRET, got.headers["x-meshserve-timestamp"], got.body, got.headers["x-meshserve-signature"])
        bodies[got.path] = json.loads(got.body)
    assert {path: (body["taskId"], body["tenant"]) for path, body in bodies.items()} == {
        "/hooks/a/done": (own.task_id, "a"), "/hooks/b/done": (other.task_id, "b")}
    assert (await get_task(stub, own.task_id, KEY_A)).tenant == "a"


@pytest.mark.parametrize("entry, message", [
    ('callback_allow = "https://x.example/"', "'callback_allow' must be a list of URL prefixes"),
    ('callback_allow = ["ftp://x.example/"]', "'callback_allow': 'ftp://x.example/': expected http(s)://host"),
])
def test_a_malformed_callback_allow_is_refused_naming_the_tenant(tmp_path, entry, message):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenants]]\nname = "a"\napi_keys = ["key-a"]\n{entry}\n')
    with pytest.raises(ValueError, match="tenants\\[0\\] \\(a\\)") as info:
        TenantRegistry.from_file(path)
    assert message in str(info.value)
