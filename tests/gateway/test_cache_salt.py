"""vLLM's ``cache_salt`` in the gateway: the HTTP routes, gRPC ``Generate`` and tasks send it
to the executor and salt the routing hashes with it (as the executor salts its chain: the
tenant, then the salt); no salt is today's request exactly; a bad one is a 400 /
INVALID_ARGUMENT naming it; the result cache keys on it."""

from __future__ import annotations

import json
from contextlib import aclosing

import grpc
import pytest

from gateway.events import ChoiceResult
from gateway.generation import GatewayCore
from gateway.request import GenerationRequest
from gateway.result_cache import ResultCache
from gateway.tenants import Tenant
from meshserve.block_hash import cache_salt, routing_block_hashes
from meshserve.client import build_request
from meshserve.sampling import SamplingParams
from meshserve.v1 import gateway_pb2
from tests.support.inprocess_app import MODEL, ScriptedMesh, finished_task, gateway_clients

PROMPT = "The quick brown fox jumps over the lazy dog, " * 4  # 41 tokens: 2 full blocks of 16
CHAT = [{"role": "user", "content": PROMPT}]


def routing_hashes(prompt_ids, salt: str = "") -> tuple[bytes, ...]:
    """The chain an executor of ``MODEL`` caches the prompt under for tenant "default" and ``salt``."""
    return tuple(routing_block_hashes(prompt_ids, 16, MODEL.model_id, MODEL.revision,
                                      cache_salt=cache_salt("tenant", "default", salt)))


async def test_every_adapter_sends_the_salt_and_salts_the_routing_hashes(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Yes", add_special_tokens=False))
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
            assert (await http.post(route, json={**body, "cache_salt": "s1", "max_tokens": 1})).status_code == 200
        [m async for m in stub.Generate(build_request(PROMPT, max_tokens=1, cache_salt="s1"))]
        task = await finished_task(http, {"prompt": PROMPT, "max_tokens": 1, "cache_salt": "s1"})
        await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})  # no salt
    assert task["state"] == "TASK_STATE_SUCCEEDED"
    assert mesh.cache_salts == ["s1", "s1", "s1", "s1", ""]
    assert len(mesh.prompts[0]) == 41 and mesh.prompts[2] == mesh.prompts[3] == mesh.prompts[4] == mesh.prompts[0]
    hashes = [a.block_hashes for a in mesh.admissions]
    assert [len(h) for h in hashes] == [2, 4, 2, 2, 2]  # the chat template adds two blocks
    assert hashes[0] == hashes[2] == hashes[3] == routing_hashes(mesh.prompts[0], "s1")
    assert hashes[1] == routing_hashes(mesh.prompts[1], "s1")
    assert hashes[4] == routing_hashes(mesh.prompts[0]) != hashes[0]  # no salt: the tenant's chain, as before


TOO_LONG = "s" * 257


@pytest.mark.parametrize("salt, message", [
    ("", "cache_salt must be a non-empty string when set"),
    (TOO_LONG, "cache_salt has 257 characters; the limit is 256"),
])
async def test_a_bad_salt_is_a_400_and_invalid_argument_naming_it(tokenizer, salt, message):
    mesh = ScriptedMesh(())
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        answers = [await http.post(route, json={**body, "cache_salt": salt}) for route, body in (
            ("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT}),
            ("/v1/tasks", {"prompt": "Hi"}))]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(build_request("Hi", cache_salt=salt))]
        with pytest.raises(grpc.aio.AioRpcError) as task_err:
            await stub.SubmitTask(build_request("Hi", cache_salt=salt))
    error = {"message": message, "type": "invalid_request_error", "param": "cache_salt", "code": "invalid_value"}
    assert [(r.status_code, r.json()) for r in answers] == [(400, {"error": error})] * 3
    for e in (err.value, task_err.value):
        assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert mesh.prompts == [] and mesh.admissions == []


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "Hi"}), ("/v1/tasks", {"prompt": "Hi"})])
async def test_a_salt_that_is_no_string_or_not_unicode_is_a_400_naming_it(tokenizer, route, body):
    async with gateway_clients(tokenizer, grpc=False) as (http, _):
        number = await http.post(route, json={**body, "cache_salt": 7})
        surrogate = await http.post(route, content=json.dumps({**body, "cache_salt": "ab\ud800"}),
                                    headers={"content-type": "application/json"})  # JSON escapes it: \ud800
    assert (number.status_code, number.json()["error"]["message"], number.json()["error"]["param"]) == (
        400, "cache_salt: Input should be a valid string", "cache_salt")
    assert (surrogate.status_code, surrogate.json()["error"]["message"], surrogate.json()["error"]["param"]) == (
        400, "cache_salt is not valid Unicode: a lone surrogate at character 2", "cache_salt")


async def test_the_result_cache_serves_a_salted_request_only_the_same_salts_answer(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Yes", add_special_tokens=False))
    core = GatewayCore(tokenizer, MODEL, mesh, result_cache=ResultCache(8, ttl_s=60.0))

    async def cached(salt: str | None) -> bool:
        request = GenerationRequest(prompt="Hi", sampling=SamplingParams(temperature=0.0, max_tokens=1),
                                    cache_salt=salt)
        async with aclosing(core.generate(request, Tenant("default"))) as events:
            (result,) = [e async for e in events if isinstance(e, ChoiceResult)]
        return result.cached

    try:
        hits = [await cached(s) for s in ("s1", "s1", "s2", None, None, "s2")]
    finally:
        await core.close()
    assert hits == [False, True, False, False, True, True]
    assert mesh.cache_salts == ["s1", "s2", ""]


async def test_grpc_leaves_the_salt_unset_unless_the_request_sets_it(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Yes", add_special_tokens=False))
    async with gateway_clients(tokenizer, mesh) as (_, stub):
        request = gateway_pb2.GenerateRequest(prompt=PROMPT)
        request.sampling.max_tokens = 1
        [m async for m in stub.Generate(request)]
    assert mesh.cache_salts == [""] and mesh.admissions[0].block_hashes == routing_hashes(mesh.prompts[0])
