"""A task's retry runs under ``"<request_id>.attempt<n>"`` (``attempt_request_id``): a
caller's valid id of any length keeps a valid retry id, so a task that loses its
executor once succeeds on attempt 2 instead of failing as the caller's mistake. The
mesh is a ``MeshClient`` whose executor goes away on the first call."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gateway.events import FinishReason
from gateway.generation import GatewayCore
from gateway.mesh import Assignment, ExecutorOutput
from gateway.request import ModelInfo
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.errors import Unavailable
from meshserve.request_ids import MAX_REQUEST_ID_LEN, attempt_request_id
from meshserve.v1 import gateway_pb2

MODEL = ModelInfo("test-model", max_model_len=64, vocab_size=49152)


def test_the_attempt_suffix_fits_the_limit():
    assert attempt_request_id("job", 2) == "job.attempt2"
    assert attempt_request_id("a" * (MAX_REQUEST_ID_LEN - 9), 2) == "a" * (MAX_REQUEST_ID_LEN - 9) + ".attempt2"
    first, second = "batch/" + "x" * 246 + "0001", "batch/" + "x" * 246 + "0002"  # valid, differing at the end
    digest = hashlib.sha256(first.encode()).hexdigest()[:16]
    assert attempt_request_id(first, 3) == first[: MAX_REQUEST_ID_LEN - 26] + "~" + digest + ".attempt3"
    assert attempt_request_id(first, 3) != attempt_request_id(second, 3)
    assert len(attempt_request_id(first, 10)) == MAX_REQUEST_ID_LEN


class ExecutorGoesAwayOnce:
    """A ``MeshClient``: every Admit is assigned at once; the first Execute fails with
    UNAVAILABLE (the executor went away), the next ones answer one token. It records
    the request id of each Execute."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def admit(self, admission, span):
        yield Assignment("e1", "127.0.0.1:1", f"lease-{len(self.request_ids)}", 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        self.request_ids.append(request_id)
        if len(self.request_ids) == 1:
            raise Unavailable("executor e1: went away")
        yield ExecutorOutput(0, (100,), FinishReason.LENGTH)

    async def release(self, *args) -> None:
        pass

    async def renew(self, *args) -> None:
        pass

    async def close(self) -> None:
        pass


class Caller:
    def invocation_metadata(self):
        return ()


@pytest.mark.parametrize("length", [MAX_REQUEST_ID_LEN, 12])
async def test_a_task_with_a_request_id_of_any_valid_length_is_retried_to_success(tokenizer, length):
    mesh = ExecutorGoesAwayOnce()
    api = TaskAPI(GatewayCore(tokenizer, MODEL, mesh), TenantRegistry.open(),
                  TaskRunner(MemoryTaskStore(), retry_backoff_s=0.01))
    try:
        request_id = "r" * length
        request = gateway_pb2.GenerateRequest(prompt="Hi", request_id=request_id)
        request.sampling.max_tokens = 1
        handle = await api.submit(request, Caller())
        finished = (gateway_pb2.TASK_STATE_SUCCEEDED, gateway_pb2.TASK_STATE_FAILED)
        for _ in range(12_000):  # a hang bound (60 s)
            status = await api.get(gateway_pb2.TaskQuery(task_id=handle.task_id), Caller())
            if status.state in finished:
                break
            await asyncio.sleep(0.005)
        assert (status.state, status.attempt, status.error.code) == (gateway_pb2.TASK_STATE_SUCCEEDED, 2, "")
        assert mesh.request_ids == [request_id, attempt_request_id(request_id, 2)]
        assert [(list(c.token_ids), c.result.request_id) for c in status.choices] == [([100], mesh.request_ids[1])]
    finally:
        await api.close()
