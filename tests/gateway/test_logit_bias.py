"""OpenAI's ``logit_bias`` in the gateway: the HTTP routes (string keys), gRPC ``Generate``
and tasks send the executor the same validated pairs, sorted by token id; ``null`` and
``{}`` are none; a bad key, an id outside the vocabulary, a bias outside [-100, 100] or
not finite, and more than 300 entries are a 400 / INVALID_ARGUMENT naming the entry
before any admission; the result cache keys on the bias."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.result_cache import ResultCache
from meshserve.client import build_request
from tests.support.inprocess_app import MODEL, ScriptedMesh, finished_task, gateway_clients

CHAT = [{"role": "user", "content": "Hi"}]
ROUTES = (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT}),
          ("/v1/tasks", {"prompt": "Hi"}))


async def test_every_adapter_sends_the_bias_sorted_by_token_id(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Yes", add_special_tokens=False))
    bias = {"17": -100, "5": 2.5}
    async with gateway_clients(tokenizer, mesh) as (http, stub):
        for route, body in ROUTES[:2]:
            r = await http.post(route, json={**body, "logit_bias": bias, "max_tokens": 1})
            assert r.status_code == 200, r.text
        [m async for m in stub.Generate(build_request("Hi", max_tokens=1, logit_bias={17: -100.0, 5: 2.5}))]
        task = await finished_task(http, {"prompt": "Hi", "max_tokens": 1, "logit_bias": bias})
        for none in (None, {}):
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logit_bias": none})
            assert r.status_code == 200, r.text
    assert task["state"] == "TASK_STATE_SUCCEEDED"
    assert [p.logit_bias for p in mesh.params] == [((5, 2.5), (17, -100.0))] * 4 + [()] * 2


BAD = [
    ({"abc": 1.0}, "logit_bias: key 'abc' is not a token id (a decimal integer as OpenAI's clients write it, "
                   "such as \"50256\")", "logit_bias"),
    ({"05": 1.0}, "logit_bias: key '05' is not a token id (a decimal integer as OpenAI's clients write it, "
                  "such as \"50256\")", "logit_bias"),
    ({str(MODEL.vocab_size): 1.0}, "logit_bias[49152]: token id 49152 is outside the vocabulary [0, 49152)",
     "logit_bias.49152"),
    ({"-1": 1.0}, "logit_bias[-1]: token id -1 is outside the vocabulary [0, 49152)", "logit_bias.-1"),
    ({"9": 100.5}, "logit_bias[9] must be in [-100, 100], got 100.5", "logit_bias.9"),
    ({"9": -1000}, "logit_bias[9] must be in [-100, 100], got -1000.0", "logit_bias.9"),
    ({str(i): 1.0 for i in range(301)}, "logit_bias takes at most 300 entries, got 301", "logit_bias"),
]


@pytest.mark.parametrize("bias, message, param", BAD)
async def test_a_bad_bias_is_a_400_naming_it_on_every_route(tokenizer, bias, message, param):
    mesh = ScriptedMesh(())
    async with gateway_clients(tokenizer, mesh, grpc=False) as (http, _):
        answers = [await http.post(route, json={**body, "logit_bias": bias}) for route, body in ROUTES]
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}
    assert [(r.status_code, r.json()) for r in answers] == [(400, {"error": error})] * 3
    assert mesh.prompts == [] and mesh.admissions == []


async def test_a_nan_bias_is_a_400_naming_its_key(tokenizer):
    """JSON has no NaN, but Python's parser (and so FastAPI's, vLLM's) reads the literal."""
    async with gateway_clients(tokenizer, grpc=False) as (http, _):
        r = await http.post("/v1/completions", content='{"prompt": "Hi", "logit_bias": {"9": NaN}}',
                            headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (
        400, "logit_bias.9", "logit_bias[9] must be in [-100, 100], got nan")


@pytest.mark.parametrize("bias, message", [
    ({49152: 1.0}, "logit_bias[49152]: token id 49152 is outside the vocabulary [0, 49152)"),
    ({-3: 1.0}, "logit_bias[-3]: token id -3 is outside the vocabulary [0, 49152)"),
    ({9: 101.0}, "logit_bias[9] must be in [-100, 100], got 101.0"),
    ({9: float("nan")}, "logit_bias[9] must be in [-100, 100], got nan"),
    ({9: float("-inf")}, "logit_bias[9] must be in [-100, 100], got -inf"),
    ({i: 1.0 for i in range(301)}, "logit_bias takes at most 300 entries, got 301"),
])
async def test_a_bad_bias_over_grpc_is_invalid_argument_naming_it(tokenizer, bias, message):
    mesh = ScriptedMesh(())
    async with gateway_clients(tokenizer, mesh) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(build_request("Hi", logit_bias=bias))]
        with pytest.raises(grpc.aio.AioRpcError) as task_err:
            await stub.SubmitTask(build_request("Hi", logit_bias=bias))
    for e in (err.value, task_err.value):
        assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert mesh.prompts == [] and mesh.admissions == []


async def test_the_result_cache_keeps_one_entry_per_bias(tokenizer):
    mesh = ScriptedMesh(tokenizer.encode(" Yes", add_special_tokens=False))
    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
    async with gateway_clients(tokenizer, mesh, grpc=False, result_cache=ResultCache(16)) as (http, _):
        for bias in (None, {"5": 1.0}, {"5": 2.0}, {"6": 1.0}, {"5": 1.0, "6": 1.0},  # five entries
                     {"5": 1.0}, {"6": 1.0, "5": 1.0}, {}, None):  # hits: the same bias (any key order), none
            r = await http.post("/v1/completions", content=json.dumps({**body, "logit_bias": bias}),
                                headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
    assert [p.logit_bias for p in mesh.params] == [(), ((5, 1.0),), ((5, 2.0),), ((6, 1.0),), ((5, 1.0), (6, 1.0))]
