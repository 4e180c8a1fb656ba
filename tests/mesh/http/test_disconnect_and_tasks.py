"""A client that leaves cancels its request and frees its KV blocks (case C31), and
the async task API over HTTP (submit, get, cancel; tenants apart)."""

import asyncio
import json

import httpx2 as httpx
import pytest

from meshserve.client import build_request, generate
from tests.support.http_mesh import KEY_A, KEY_B, SERVED
from tests.support.mesh_harness import wait_for_condition

pytestmark = pytest.mark.model
AUTH_A = {"authorization": f"Bearer {KEY_A}"}
ESSAY = {"model": SERVED, "messages": [{"role": "user", "content": "Write a long essay about oceans."}],
         "max_tokens": 900, "ignore_eos": True, "temperature": 0}


async def _all_free(mesh) -> None:
    await mesh.wait_released()  # the gateway releases the lease just after the engine frees the blocks
    stats = mesh.executors[0][1].stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    assert mesh.scheduler.servicer.core.num_leases() == 0


async def test_streamed_request_closed_after_five_events_frees_its_blocks(http_mesh):
    """Case C31 (max_tokens 900: the test model's context is 1024): the essay streamed, closed by the
    client after 5 events: the engine aborts it and every KV block is free again, the lease released."""
    engine = http_mesh.executors[0][1]
    async with httpx.AsyncClient(base_url=http_mesh.http_url, timeout=None) as http:
        async with http.stream("POST", "/v1/chat/completions", json={**ESSAY, "stream": True},
                               headers=AUTH_A) as response:
            assert response.status_code == 200
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 5:
                    break
            assert engine.stats().num_running == 1  # still generating when the client leaves
    await _all_free(http_mesh)


async def test_unstreamed_request_whose_client_leaves_frees_its_blocks(http_mesh):
    """Case C31: the essay not streamed, the client gone while it generates: cancelled
    upstream, every block free again."""
    engine = http_mesh.executors[0][1]
    async with httpx.AsyncClient(base_url=http_mesh.http_url, timeout=None) as http:
        call = asyncio.create_task(http.post("/v1/chat/completions", json=ESSAY, headers=AUTH_A))
        await wait_for_condition(lambda: engine.stats().num_running == 1, what="the essay running")
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    await _all_free(http_mesh)


async def _task_state(http, task_id, headers, until=("TASK_STATE_SUCCEEDED", "TASK_STATE_FAILED",
                                                      "TASK_STATE_CANCELLED"), timeout_s=300.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s  # a hang bound
    while True:
        r = await http.get(f"/v1/tasks/{task_id}", headers=headers)
        assert r.status_code == 200, r.text
        if r.json()["state"] in until:
            return r.json()
        assert loop.time() < deadline, r.json()
        await asyncio.sleep(0.05)


async def test_task_over_http_runs_on_after_its_submit_connection_closes(http_mesh):
    """Case C31: an async task whose submitting connection closes keeps running; its
    result equals the gRPC path's; another tenant cannot see it (404)."""
    chat = [("user", "Name three rivers.")]
    ref = await generate(http_mesh.stub, build_request(chat=chat, max_tokens=16, temperature=0),
                         (("x-api-key", KEY_A),))
    body = {"model": SERVED, "messages": [{"role": r, "content": c} for r, c in chat], "max_tokens": 16,
            "temperature": 0}
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/tasks", json=body, headers=AUTH_A)
    assert r.status_code == 202 and r.json()["state"] == "TASK_STATE_QUEUED"
    task_id = r.json()["task_id"]
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        status = await _task_state(http, task_id, AUTH_A)
        other = await http.get(f"/v1/tasks/{task_id}", headers={"authorization": f"Bearer {KEY_B}"})
    assert status["state"] == "TASK_STATE_SUCCEEDED"
    [choice] = status["choices"]
    assert choice["text"] == ref.text and choice["token_ids"] == ref.token_ids
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"


async def test_task_over_http_cancelled_frees_its_blocks(http_mesh):
    engine = http_mesh.executors[0][1]
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/tasks", json=ESSAY, headers=AUTH_A)
        task_id = r.json()["task_id"]
        await wait_for_condition(lambda: engine.stats().num_running == 1, what="the task running")
        cancelled = await http.post(f"/v1/tasks/{task_id}/cancel", headers=AUTH_A)
        assert cancelled.status_code == 200
        status = await _task_state(http, task_id, AUTH_A)
    assert status["state"] == "TASK_STATE_CANCELLED"
    await _all_free(http_mesh)


async def test_task_with_a_bad_parameter_is_400_and_not_stored(http_mesh):
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/tasks", json={"prompt": "Hi", "top_p": 0}, headers=AUTH_A)
        missing = await http.get("/v1/tasks/task-0123", headers=AUTH_A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert missing.status_code == 404
