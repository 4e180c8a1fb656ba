"""The async task API over loopback, without a model: a gateway whose scheduler is
unreachable. Submit validates at once; the task then fails with UNAVAILABLE;
tenancy, TTL expiry, CancelTask of a finished task, and the poll spans' links to
the submit span. (Real generations: tests/mesh/test_tasks.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from gateway.server import start_gateway
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.client import build_request, cancel_task, channel, get_task, submit_task, wait_task
from meshserve.telemetry import memory_exporter
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.redis_server import free_port

TTL_S = 1.0
KEY_A, KEY_B = (("x-api-key", "key-a"),), (("x-api-key", "key-b"),)


class StoreClock:
    """The task store's clock (expiry only): it stands still until a test advances it,
    so records expire without waiting, and never while a slow CLI start-up reads them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture(scope="module")
async def gateway(tmp_path_factory):
    from meshserve.cli.processes import model_info

    try:
        tokenizer, info = await asyncio.to_thread(model_info, "default")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text('[[tenants]]\nname = "a"\napi_keys = ["key-a"]\n\n[[tenants]]\nname = "b"\napi_keys = ["key-b"]\n')
    clock = StoreClock()
    svc = await start_gateway(tokenizer, info, f"127.0.0.1:{free_port()}", 0,
                              tenants=TenantRegistry.from_file(path),
                              tasks=TaskRunner(MemoryTaskStore(ttl_s=TTL_S, clock=clock)))
    ch = channel(svc.address)
    stub = gateway_pb2_grpc.GatewayStub(ch)
    stub.address = svc.address  # for the CLI test
    stub.store_clock = clock
    yield stub
    await ch.close()
    await svc.stop(0.5)
    await svc.servicer.close()


def request(**kw) -> gateway_pb2.GenerateRequest:
    return build_request(kw.pop("prompt", "Hello"), max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)


async def test_bad_parameters_fail_at_submit(gateway):
    cases = [(request(top_p=0.0), "top_p"), (request(prompt=""), "empty"), (request(n=17), "n must be"),
             (request(prompt=[1, 10**9]), "vocabulary")]
    for req, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit_task(gateway, req, KEY_A)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit_task(gateway, request())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_task_that_fails_later_is_failed_with_code_and_message(gateway):
    handle = await submit_task(gateway, request(request_id="my-req"), KEY_A)
    assert handle.state == gateway_pb2.TASK_STATE_QUEUED and handle.task_id.startswith("task-")
    assert len(handle.task_id) == len("task-") + 32
    status = await wait_task(gateway, handle.task_id, KEY_A, poll_s=0.02, timeout_s=30)
    assert status.state == gateway_pb2.TASK_STATE_FAILED
    assert status.error.code == "UNAVAILABLE" and status.error.message.startswith("scheduler: ")
    assert (status.task_id, status.request_id, len(status.choices), status.tenant) == (handle.task_id, "my-req", 0, "a")
    assert 0 < status.created_at_unix_s <= status.finished_at_unix_s and status.started_at_unix_s == 0
    # the request id is free again once the task is over
    again = await submit_task(gateway, request(request_id="my-req"), KEY_A)
    assert again.task_id != handle.task_id
    # cancelling a finished task returns it unchanged
    assert (await cancel_task(gateway, handle.task_id, KEY_A)) == status


async def test_tasks_are_visible_to_their_tenant_only(gateway):
    handle = await submit_task(gateway, request(), KEY_A)
    for call in (get_task, cancel_task):
        for task_id, key in ((handle.task_id, KEY_B), ("task-" + "0" * 32, KEY_A)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(gateway, task_id, key)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert info.value.details() == f"task {task_id!r} not found"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_task(gateway, "", KEY_A)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await wait_task(gateway, handle.task_id, KEY_A, 0.02, 30)).state == gateway_pb2.TASK_STATE_FAILED


async def test_an_overlong_task_id_is_an_invalid_argument_that_does_not_echo_it(gateway):
    """Found by a fresh user: a 100,000-character task_id was echoed into the error
    details and overflowed the trailer (RESOURCE_EXHAUSTED from the transport)."""
    for call in (get_task, cancel_task):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(gateway, "x" * 100_000, KEY_A)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "task_id has 100000 characters; the limit is 256"


async def test_finished_tasks_expire_after_the_ttl(gateway):
    handle = await submit_task(gateway, request(), KEY_B)
    status = await wait_task(gateway, handle.task_id, KEY_B, poll_s=0.02, timeout_s=30)
    assert status.state == gateway_pb2.TASK_STATE_FAILED
    gateway.store_clock.now += TTL_S * 1.2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_task(gateway, handle.task_id, KEY_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_poll_spans_link_to_the_submit_span(gateway):
    memory_exporter().clear()
    submit_trace, poll_trace = 0x1111111111111111AAAAAAAAAAAAAAAA, 0x2222222222222222BBBBBBBBBBBBBBBB
    caller = 0x00F067AA0BA902B7
    tp = (lambda t: (("traceparent", f"00-{t:032x}-{caller:016x}-01"),))
    handle = await submit_task(gateway, request(), KEY_A + tp(submit_trace))
    status = await wait_task(gateway, handle.task_id, KEY_A + tp(poll_trace), poll_s=0.02, timeout_s=30)
    await get_task(gateway, handle.task_id, KEY_A)        # a poll with no caller context: its own trace
    spans = memory_exporter().get_finished_spans()
    submit = [s for s in spans if s.name == "gateway.submit_task"]
    assert len(submit) == 1 and submit[0].context.trace_id == submit_trace
    assert submit[0].parent.span_id == caller and submit[0].attributes["meshserve.task_id"] == handle.task_id
    run = [s for s in spans if s.attributes.get("meshserve.task_id") == handle.task_id
           and s.name.startswith("text_completion ")]
    # UNAVAILABLE is retried: each of the 3 attempts has its span, a child of the submit span
    assert len(run) == 3 and status.attempt == 3 and status.last_error.startswith("attempt 2: UNAVAILABLE: scheduler")
    for attempt in run:
        assert attempt.parent.span_id == submit[0].context.span_id
        assert attempt.context.trace_id == submit_trace and attempt.status.status_code.name == "ERROR"
    polls = [s for s in spans if s.name == "gateway.get_task"]
    assert len(polls) >= 2 and status.state == gateway_pb2.TASK_STATE_FAILED
    for poll in polls:
        assert [(link.context.trace_id, link.context.span_id) for link in poll.links] == [
            (submit_trace, submit[0].context.span_id)]
        assert poll.attributes["meshserve.task_id"] == handle.task_id and poll.kind.name == "SERVER"
    assert {p.context.trace_id for p in polls[:-1]} == {poll_trace}
    assert polls[-1].context.trace_id not in (poll_trace, submit_trace) and polls[-1].parent is None
    assert polls[-2].attributes["meshserve.task.state"] == "FAILED"


async def meshserve(*args: str) -> tuple[int, str, str]:
    """Runs ``python -m meshserve.cli ARGS`` while this event loop keeps serving."""
    import sys

    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "meshserve.cli", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_generate_async_and_task(gateway):
    import json

    addr = gateway.address
    code, out, _ = await meshserve("generate", "--async", "--addr", addr, "--api-key", "key-a", "--prompt", "Hi",
                                   "--max-tokens", "2", "--json")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["code"] == "UNAVAILABLE" and error["message"].startswith("scheduler: ")

    handle = await submit_task(gateway, request(), KEY_A)
    code, out, _ = await meshserve("task", handle.task_id, "--wait", "--addr", addr, "--api-key", "key-a")
    status = json.loads(out)
    assert (code, status["task_id"], status["state"], status["error"]["code"]) == (
        1, handle.task_id, "TASK_STATE_FAILED", "UNAVAILABLE")
    from google.protobuf.json_format import MessageToDict
    full = MessageToDict(await get_task(gateway, handle.task_id, KEY_A), preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    assert status == full  # every field, zeros too, as GET /v1/tasks/{id} prints them
    code, out, err = await meshserve("task", handle.task_id, "--addr", addr, "--api-key", "key-b")
    assert (code, out, err.strip()) == (1, "", f"error: NOT_FOUND: task {handle.task_id!r} not found")
