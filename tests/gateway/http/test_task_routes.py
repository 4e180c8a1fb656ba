"""``POST /v1/tasks`` with a ``callback_url``, without a model: a gateway whose
scheduler is unreachable (every task fails with UNAVAILABLE, which is still a final
state to call back about), its HTTP port and a callback allow-list naming a local
receiver. Found by a fresh user: the HTTP route dropped ``callback_url`` silently
(202, no callback), even for an internal address."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio

from gateway.callbacks import CallbackPolicy, CallbackSender
from gateway.tenants import TenantRegistry
from tests.support.http_receiver import Receiver
from tests.support.mesh_harness import wait_for_condition
from tests.support.served_gateway import served_gateway

SECRET = b"task-routes-secret"


@pytest_asyncio.fixture
async def served():
    receiver = await Receiver().start()
    async with served_gateway(callbacks=CallbackSender(CallbackPolicy([receiver.url + "/"]), SECRET, max_attempts=1,
                                                       backoff_s=0.001)) as (client, _):
        yield client, receiver
    await receiver.stop()


BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


async def test_a_task_submitted_over_http_calls_its_callback_url_back(served):
    client, receiver = served
    resp = await client.post("/v1/tasks", json={**BODY, "callback_url": receiver.url + "/done"})
    assert resp.status_code == 202, resp.text
    task_id = resp.json()["task_id"]
    await wait_for_condition(lambda: len(receiver.received) == 1, what="the task's callback POST")
    assert receiver.received[0].headers["x-meshserve-task-id"] == task_id
    status = (await client.get(f"/v1/tasks/{task_id}")).json()
    assert (status["state"], status["callback"]["url"]) == ("TASK_STATE_FAILED", receiver.url + "/done")


@pytest.mark.parametrize("callback_url, message", [
    ("http://169.254.169.254/latest", "callback_url names an internal address (169.254.169.254)"),
    (123, "callback_url must be a string"),
    ("http://x/\ud800", "callback_url is not valid Unicode: a lone surrogate at character 9"),  # was a 500
])
async def test_a_refused_callback_url_is_a_400_naming_it_and_no_task(served, callback_url, message):
    client, receiver = served
    resp = await client.post("/v1/tasks", content=json.dumps({**BODY, "callback_url": callback_url}).encode(),
                             headers={"content-type": "application/json"})  # json.dumps escapes a surrogate
    assert resp.status_code == 400
    assert (resp.json()["error"]["message"], resp.json()["error"]["param"]) == (message, "callback_url")
    assert receiver.received == []


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer no-such-key"}])
async def test_a_task_without_a_valid_key_is_401_before_its_body_is_judged(tmp_path, headers):
    """Found by a review: a bad body was judged (400 naming the field) before the key."""
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["key-acme"]\n')
    async with served_gateway(tenants=TenantRegistry.from_file(path)) as (client, _):
        resp = await client.post("/v1/tasks", json={**BODY, "temperature": -5}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        resp = await client.post("/v1/tasks", json={**BODY, "temperature": -5},
                                 headers={"authorization": "Bearer key-acme"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
