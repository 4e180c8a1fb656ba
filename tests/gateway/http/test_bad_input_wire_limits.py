"""Bad input over the public API is a 400 / INVALID_ARGUMENT, never a 500: values the
wire (int32, int64, UTF-8) cannot carry; and a bad prompt among several strands no lease."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from gateway.generation import GatewayCore
from gateway.request import GenerationRequest, ModelInfo
from gateway.tenants import Tenant
from meshserve.errors import InvalidArgument
from meshserve.request_ids import check_request_id
from meshserve.sampling import SamplingParams, validate
from tests.support.served_gateway import served_gateway


def test_top_k_past_the_wire_int32_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="top_k"):
        validate(SamplingParams(top_k=2**31), max_model_len=64, vocab_size=49152)


def test_a_request_id_with_a_lone_surrogate_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="request_id"):
        check_request_id("\ud800")


async def test_priority_past_the_wire_int32_is_invalid_argument(tokenizer):
    core = GatewayCore(tokenizer, ModelInfo("m", 64, 49152), mesh=None)
    with pytest.raises(InvalidArgument, match="priority"):
        core.prepare(GenerationRequest(prompt="Hi", priority=2**40), Tenant("default"))


class GrantsAtOnce:
    """A ``MeshClient`` whose scheduler grants the lease the moment Admit arrives;
    its assignment message reaches the gateway a little later. Records grants and
    releases."""

    def __init__(self) -> None:
        self.granted: list[str] = []
        self.released: list[str] = []

    async def admit(self, admission, span):
        from gateway.mesh import Assignment
        lease_id = f"lease-{admission.request_id}"
        self.granted.append(lease_id)
        await asyncio.sleep(0.05)  # on the wire
        yield Assignment("e1", "127.0.0.1:1", lease_id, 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        await asyncio.Event().wait()
        yield

    async def release(self, lease_id, num_generated_tokens, finished, span):
        self.released.append(lease_id)

    async def close(self):
        pass


@pytest_asyncio.fixture
async def served():
    async with served_gateway() as served:
        yield served


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"priority": 2**40}),
    ("/v1/chat/completions", {"request_id": "\ud800"}),
    ("/v1/tasks", {"max_tokens": 10**20}),
    ("/v1/tasks", {"seed": 2**64}),
    ("/v1/tasks", {"stop_token_ids": [2**64]}),
    ("/v1/tasks", {"min_tokens": 2**63}),
    ("/v1/tasks", {"top_k": 2**31}),
    ("/v1/tasks", {"priority": 2**31}),
    ("/v1/tasks", {"request_id": "\ud800"}),
    ("/v1/tasks", {"messages": [{"role": "user", "content": "Hi \ud800"}]}),
    ("/v1/tasks", {"stop": "\udfff"}),
])
async def test_a_value_the_wire_cannot_carry_is_a_400_not_a_500(served, path, extra):
    client, _ = served
    resp = await client.post(path, content=json.dumps({**CHAT, **extra}),  # ASCII: a lone surrogate as \\ud800
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text


async def test_a_bad_prompt_among_several_admits_none(served):
    client, svc = served
    mesh = svc.servicer.core.runner.mesh = GrantsAtOnce()
    resp = await client.post("/v1/completions", json={"prompt": [[1, 2], []], "max_tokens": 4})
    assert resp.status_code == 400, resp.text
    await asyncio.sleep(0.2)
    assert set(mesh.granted) <= set(mesh.released), f"leases stranded: {set(mesh.granted) - set(mesh.released)}"
