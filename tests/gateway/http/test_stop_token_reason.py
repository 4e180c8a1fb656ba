"""vLLM's ``stop_reason`` for a choice one of ``stop_token_ids`` ended: its id (an int)
on HTTP, ``GenerateResult.stop_token_id`` on gRPC; the stop string when one ended it;
null / unset for the length and the model's EOS (which comes first unless
``ignore_eos``, as in vLLM's ``check_stop``). Streamed and not, chat and completions;
the same from the result cache (memory and Redis) and in a task's result."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gateway.events import FinishReason
from gateway.result_cache import ResultCache
from meshserve.client import build_request, generate
from tests.support.inprocess_app import MODEL, ScriptedMesh, app_client, finished_task, gateway_clients

CHAT = [{"role": "user", "content": "Hi"}]
OUTPUT = "The answer is 42. Done here"
ROUTES = [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Q:"})]


def ids_of(tokenizer, extra: tuple[int, ...] = ()) -> list[int]:
    return tokenizer.encode(OUTPUT, add_special_tokens=False) + list(extra)


async def stop_reasons(http, route: str, body: dict) -> tuple[list, list]:
    """(finish_reason, stop_reason) of each choice: of the whole response, of the stream."""
    full = await http.post(route, json=body)
    streamed = await http.post(route, json={**body, "stream": True})
    assert full.status_code == streamed.status_code == 200, (full.text, streamed.text)
    whole = [(c["finish_reason"], c["stop_reason"]) for c in full.json()["choices"]]
    chunks = []
    for line in streamed.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks += [(c["finish_reason"], c["stop_reason"]) for c in json.loads(line[6:])["choices"]
                       if c["finish_reason"]]
    return whole, chunks


def cases(tokenizer):
    """(mesh's last token, its finish reason, request fields, want finish, want stop_reason)."""
    last = ids_of(tokenizer)[-1]  # " here"
    eos = tokenizer.eos_token_id
    return [
        ((), FinishReason.STOP, {"stop_token_ids": [last]}, "stop", last),
        ((), FinishReason.STOP, {"stop_token_ids": [5, last], "ignore_eos": True}, "stop", last),
        ((), FinishReason.LENGTH, {"stop_token_ids": [5]}, "length", None),
        ((eos,), FinishReason.STOP, {}, "stop", None),  # the model's EOS
        ((eos,), FinishReason.STOP, {"stop_token_ids": [eos]}, "stop", None),  # the EOS comes first
        ((eos,), FinishReason.STOP, {"stop_token_ids": [eos], "ignore_eos": True}, "stop", eos),
        ((), FinishReason.STOP, {"stop_token_ids": [last], "stop": ["42"]}, "stop", "42"),  # the string first
    ]


@pytest.mark.parametrize("route, prompt", ROUTES)
@pytest.mark.parametrize("case", range(7))
async def test_http_stop_reason_is_the_string_else_the_token_id_else_null(tokenizer, route, prompt, case):
    extra, finish, fields, want_finish, want = cases(tokenizer)[case]
    mesh = ScriptedMesh(ids_of(tokenizer, extra), finish)
    body = {**prompt, **fields, "n": 2, "max_tokens": 16, "temperature": 0}
    async with app_client(tokenizer, mesh) as http:
        whole, chunks = await stop_reasons(http, route, body)
    assert whole == chunks == [(want_finish, want)] * 2
    assert all(type(r) is type(want) for _, r in whole)  # an int stays an int


@pytest.mark.parametrize("case", range(7))
async def test_grpc_stop_token_id_is_set_only_for_a_stop_token(tokenizer, case):
    extra, finish, fields, want_finish, want = cases(tokenizer)[case]
    mesh = ScriptedMesh(ids_of(tokenizer, extra), finish)
    req = build_request(prompt="Q:", max_tokens=16, temperature=0, **fields)
    async with gateway_clients(tokenizer, mesh) as (_, stub):
        async for msg in stub.Generate(req):
            if msg.WhichOneof("kind") == "result":
                result = msg.result
    token = want if isinstance(want, int) else None
    assert (result.HasField("stop_token_id"), result.stop_token_id) == (token is not None, token or 0)
    assert result.stop_reason == (want if isinstance(want, str) else "")
    out = await _generate(tokenizer, ScriptedMesh(ids_of(tokenizer, extra), finish), req)
    assert (out.finish_reason, out.stop_token_id, out.stop_reason) == (want_finish, token, result.stop_reason)


@pytest.mark.parametrize("route, prompt", ROUTES)
@pytest.mark.parametrize("fields, want", [({}, 7), ({"stop_token_ids": [7]}, 7), ({"ignore_eos": True}, None)])
async def test_another_eos_of_the_model_is_named_as_a_stop_token(tokenizer, route, prompt, fields, want):
    """A model whose generation_config.json lists several EOS ids (Llama 3's three): vLLM
    adds those other than the tokenizer's own to stop_token_ids, so one of them that ends a
    choice is its stop_reason. With ignore_eos the executor goes on past them; here one
    still ends the choice (as it would an id of stop_token_ids), and is not named."""
    eos = tokenizer.eos_token_id
    model = dataclasses.replace(MODEL, eos_token_ids=frozenset({eos, 7}))
    body = {**prompt, **fields, "max_tokens": 16, "temperature": 0}
    async with app_client(tokenizer, ScriptedMesh(ids_of(tokenizer, (7,)), FinishReason.STOP), model) as http:
        other = await stop_reasons(http, route, body)
    async with app_client(tokenizer, ScriptedMesh(ids_of(tokenizer, (eos,)), FinishReason.STOP), model) as http:
        own = await stop_reasons(http, route, body)
    assert other == ([("stop", want)], [("stop", want)])
    assert own == ([("stop", None)],) * 2  # the tokenizer's own: never named


async def _generate(tokenizer, mesh, req):
    async with gateway_clients(tokenizer, mesh) as (_, stub):
        return await generate(stub, req)



@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("route, prompt", ROUTES)
async def test_a_result_cache_replay_gives_the_same_stop_reason(tokenizer, request, store, route, prompt):
    last = ids_of(tokenizer)[-1]
    cache = ResultCache(max_entries=8)
    if store == "redis":
        from gateway.result_store import RedisResultStore
        cache = RedisResultStore(request.getfixturevalue("redis_url"), ttl_s=30.0)
    mesh = ScriptedMesh(ids_of(tokenizer), FinishReason.STOP)
    body = {**prompt, "stop_token_ids": [last], "max_tokens": 16, "temperature": 0, "n": 2,
            "user": f"replay-{store}-{route}"}
    async with app_client(tokenizer, mesh, result_cache=cache) as http:
        first = await http.post(route, json=body)
        again = await http.post(route, json=body)
        streamed = await http.post(route, json={**body, "stream": True})
    assert len(mesh.prompts) == 1  # the cache answered the others
    for r in (first, again):
        assert [(c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]] == [("stop", last)] * 2
    finished = [c for line in streamed.text.splitlines() if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finished] == [("stop", last)] * 2


async def test_grpc_replay_from_the_result_cache_keeps_the_stop_token_id(tokenizer):
    last = ids_of(tokenizer)[-1]
    mesh = ScriptedMesh(ids_of(tokenizer), FinishReason.STOP)
    req = build_request(prompt="Q:", max_tokens=16, temperature=0, stop_token_ids=[last])
    async with gateway_clients(tokenizer, mesh, result_cache=ResultCache(max_entries=8)) as (_, stub):
        first, again = await generate(stub, req), await generate(stub, req)
    assert (first.cached, again.cached, len(mesh.prompts)) == (False, True, 1)
    assert (first.stop_token_id, again.stop_token_id) == (last, last)


@pytest.mark.parametrize("body", [{"messages": CHAT}, {"prompt": "Q:"}])
async def test_a_tasks_result_carries_the_stop_token_id(tokenizer, body):
    last = ids_of(tokenizer)[-1]
    mesh = ScriptedMesh(ids_of(tokenizer), FinishReason.STOP)
    async with app_client(tokenizer, mesh) as http:
        status = await finished_task(http, {**body, "stop_token_ids": [last], "max_tokens": 16})
        plain = await finished_task(http, {**body, "stop_token_ids": [5], "max_tokens": 16})
    assert status["state"] == plain["state"] == "TASK_STATE_SUCCEEDED"
    (choice,) = status["choices"]
    assert (choice["result"]["stop_token_id"], choice["result"].get("stop_reason", "")) == (last, "")
    assert "stop_token_id" not in plain["choices"][0]["result"]
