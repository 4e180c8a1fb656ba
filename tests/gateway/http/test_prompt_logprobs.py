"""vLLM's ``prompt_logprobs`` over HTTP, over a scripted mesh whose executor sends
``scripted_prompt_logprobs``: in completions each choice carries its prompt's, in chat
the response itself; one entry per prompt token (null first), the prompt's token with
the top k; the values equal what gRPC ``Generate`` returns for the same request;
refused when streamed and out of range (400 naming ``prompt_logprobs``); a task
carries them in its result."""

from __future__ import annotations

import asyncio

import pytest

from gateway.generation import GatewayCore
from gateway.server import GatewayServicer
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.client import Logprob, build_request
from tests.support.inprocess_app import MODEL, ScriptedMesh, app_client, scripted_prompt_logprobs

CHAT = [{"role": "user", "content": "Hi"}]
PROMPT = "The capital of France is"
BOTH_ROUTES = [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})]


def paris_mesh(tokenizer) -> ScriptedMesh:
    """A scripted mesh whose every choice answers " Paris"."""
    return ScriptedMesh(tokenizer.encode(" Paris", add_special_tokens=False))


class _Context:
    """What ``GatewayServicer.Generate`` reads of a gRPC call's context."""

    def invocation_metadata(self):
        return []


async def grpc_prompt_logprobs(tokenizer, request) -> list[Logprob]:
    """Choice 0's prompt logprobs as gRPC ``Generate`` sends them, over its own scripted mesh."""
    core = GatewayCore(tokenizer, MODEL, paris_mesh(tokenizer))
    tenants = TenantRegistry.open()
    servicer = GatewayServicer(core, tenants, TaskAPI(core, tenants, TaskRunner(MemoryTaskStore())))
    try:
        results = [m.result async for m in servicer.Generate(request, _Context()) if m.HasField("result")]
    finally:
        await servicer.close()
    [first] = [r for r in results if r.index == 0]
    return [Logprob.from_proto(lp) for lp in first.prompt_logprobs]


def check_against_the_prompt(entries: list, prompt_ids: list[int], k: int) -> None:
    """One entry per prompt token, null first; then the prompt's token first at each
    position, with the top k beside it (one more key when it is outside them)."""
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for i, (position, tid) in enumerate(zip(entries[1:], prompt_ids[1:]), 1):
        assert next(iter(position)) == str(tid)
        ranks = sorted(v["rank"] for v in position.values())
        own = ([] if k else [1]) if i % 2 == 0 else [k + 1 + i]  # the scripted rank of one outside its top k
        assert ranks == list(range(1, k + 1)) + own
        assert len(position) == (k if i % 2 == 0 and k else k + 1)


async def test_completions_exact_entries_for_a_token_prompt(tokenizer):
    """The conversion, value by value: position 1 (odd) has the prompt token outside its
    top 2 (its rank in the vocabulary, the scripted 4), position 2 (even) has it as the
    top 1 (one key, rank 1)."""
    a, b, c = tokenizer.encode(" one two three", add_special_tokens=False)
    mesh = ScriptedMesh(tokenizer.encode(" four", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={"prompt": [a, b, c], "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    text = tokenizer.decode
    assert choice["prompt_logprobs"] == [
        None,
        {str(b): {"logprob": -0.875, "rank": 4, "decoded_token": text([b])},
         "49000": {"logprob": -0.25, "rank": 1, "decoded_token": text([49000])},
         "49001": {"logprob": -0.5, "rank": 2, "decoded_token": text([49001])}},
        {str(c): {"logprob": -0.25, "rank": 1, "decoded_token": text([c])},
         "49000": {"logprob": -0.5, "rank": 2, "decoded_token": text([49000])}},
    ]
    assert list(choice)[-1] == "prompt_logprobs"  # after the choice's other fields, as vLLM's


async def test_completions_several_prompts_and_choices_each_carry_their_prompts(tokenizer):
    prompts = [PROMPT, "Hello there, how are you"]
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert sorted(mesh.prompts) == sorted(ids)  # the prompts as tokenized
    for c in body["choices"]:
        entries = c["prompt_logprobs"]
        check_against_the_prompt(entries, ids[c["index"] // 2], 3)
        assert entries == body["choices"][c["index"] // 2 * 2]["prompt_logprobs"]  # both choices of a prompt
    assert body["usage"]["prompt_tokens"] == sum(len(body["choices"][p * 2]["prompt_logprobs"]) for p in range(2))


@pytest.mark.parametrize("k", [0, 2, 20])
async def test_completions_values_equal_the_grpc_api(tokenizer, k):
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    ref = await grpc_prompt_logprobs(tokenizer, build_request(PROMPT, max_tokens=1, prompt_logprobs=k))
    assert [lp.token_id for lp in ref] == mesh.prompts[0][1:]
    check_against_the_prompt(entries, mesh.prompts[0], k)
    for position, lp in zip(entries[1:], ref, strict=True):
        assert position[str(lp.token_id)]["logprob"] == lp.logprob
        assert {t: position[str(t)]["logprob"] for t, _ in lp.top} == dict(lp.top)
        assert [position[str(t)]["rank"] for t, _ in lp.top] == list(range(1, k + 1))
    assert r.json()["usage"]["prompt_tokens"] == len(entries)


async def test_chat_carries_them_in_the_response_itself(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode("Hello!", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "max_tokens": 2,
                                                          "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert all("prompt_logprobs" not in c for c in body["choices"])
    assert list(body)[-1] == "prompt_logprobs"  # after usage, as vLLM's
    [prompt] = mesh.prompts
    assert prompt == list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    check_against_the_prompt(body["prompt_logprobs"], prompt, 1)
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    want = scripted_prompt_logprobs(prompt, 1)
    assert [p[str(e.token_id)]["logprob"] for p, e in zip(body["prompt_logprobs"][1:], want)] == [
        e.logprob for e in want]


@pytest.mark.parametrize("route, body", BOTH_ROUTES)
async def test_not_asked_no_field(tokenizer, route, body):
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(route, json={**body, "max_tokens": 1, "prompt_logprobs": None})
    assert r.status_code == 200 and "prompt_logprobs" not in r.json()
    assert "prompt_logprobs" not in r.json()["choices"][0]


@pytest.mark.parametrize("route, body", [*BOTH_ROUTES, ("/v1/completions", {"prompt": [PROMPT, "Hi"]})])
@pytest.mark.parametrize("fields, message", [
    ({"stream": True, "prompt_logprobs": 2},
     "prompt_logprobs is not available with stream: true (only a whole response carries it)"),
    ({"stream": True, "prompt_logprobs": 0},
     "prompt_logprobs is not available with stream: true (only a whole response carries it)"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20] (MAX_LOGPROBS), got -1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20] (MAX_LOGPROBS), got 21"),
    ({"prompt_logprobs": True}, "Input should be a valid integer"),
    ({"prompt_logprobs": "2"}, "Input should be a valid integer"),
])
async def test_refused_with_a_400_naming_it(tokenizer, route, body, fields, message):
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(route, json={**body, "max_tokens": 1, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and message in error["message"]
    assert mesh.prompts == []  # nothing ran


@pytest.mark.parametrize("route, body", BOTH_ROUTES)
async def test_a_stream_without_them_is_unchanged(tokenizer, route, body):
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post(route, json={**body, "max_tokens": 1, "stream": True})
    assert r.status_code == 200 and "prompt_logprobs" not in r.text and r.text.endswith("data: [DONE]\n\n")


async def test_a_task_carries_them_in_its_result(tokenizer):
    """``POST /v1/tasks`` stores them in its ``GenerateRequest`` (the sampling's
    ``prompt_logprobs``): the task's choice 0 result holds them in the proto's shape,
    as gRPC ``GetTask`` gives them."""
    mesh = paris_mesh(tokenizer)
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/tasks", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1,
                                               "stream": True})  # a task ignores stream
        assert r.status_code == 202, r.text
        for _ in range(500):
            status = (await http.get(f"/v1/tasks/{r.json()['task_id']}")).json()
            if status["state"] == "TASK_STATE_SUCCEEDED":
                break
            await asyncio.sleep(0.01)
    assert status["state"] == "TASK_STATE_SUCCEEDED", status
    got = status["choices"][0]["result"]["prompt_logprobs"]
    want = scripted_prompt_logprobs(mesh.prompts[0], 1)
    assert [(int(e["token_id"]), e["logprob"]) for e in got] == [(e.token_id, e.logprob) for e in want]
    assert [[(t["token_id"], t["logprob"]) for t in e["top"]] for e in got] == [
        [(t.token_id, t.logprob) for t in e.top] for e in want]
