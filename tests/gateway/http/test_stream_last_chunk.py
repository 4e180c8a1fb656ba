"""A stream sends a choice's last tokens and its finish reason in one chunk, as vLLM
does (``Delta.last``): no chunk of an empty text or delta carries a finish reason
alone, so a client that times every chunk (``vllm bench serve``'s inter-token
latency) counts one per token. The kept stop string of ``include_stop_str_in_output``
joins that chunk too."""

from __future__ import annotations

import json

import pytest

from gateway.events import FinishReason
from tests.support.inprocess_app import ScriptedMesh, app_client

OUTPUT = "The answer is 42. Done here"
ROUTES = [("/v1/completions", {"prompt": "Q:"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Q"}]})]


def choices_of(text: str) -> list[dict]:
    return [c for line in text.splitlines() if line.startswith("data: {") for c in json.loads(line[6:])["choices"]]


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["delta"].get("content", "")


@pytest.mark.parametrize("route, prompt", ROUTES)
async def test_the_last_tokens_chunk_carries_the_finish_reason(tokenizer, route, prompt):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    logprobs = {"logprobs": 0} if "prompt" in prompt else {"logprobs": True}
    body = {**prompt, **logprobs, "n": 2, "max_tokens": len(ids), "temperature": 0, "stream": True,
            "return_token_ids": True}
    async with app_client(tokenizer, ScriptedMesh(ids)) as http:
        chunks = choices_of((await http.post(route, json=body)).text)
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index and "role" not in c.get("delta", {})]
        assert len(mine) == len(ids)  # one chunk a token, the last with the finish reason
        assert [c["finish_reason"] for c in mine] == [None] * (len(ids) - 1) + ["length"]
        assert (text_of(mine[-1]), mine[-1]["token_ids"], mine[-1]["stop_reason"]) == (" here", [ids[-1]], None)
        assert mine[-1]["logprobs"] is not None
        assert "".join(text_of(c) for c in mine) == OUTPUT


@pytest.mark.parametrize("route, prompt", ROUTES)
async def test_a_kept_stop_string_and_a_stop_token_join_the_last_chunk(tokenizer, route, prompt):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    body = {**prompt, "max_tokens": 16, "temperature": 0, "stream": True, "stop": ["."],
            "include_stop_str_in_output": True}
    async with app_client(tokenizer, ScriptedMesh(ids)) as http:
        kept = [c for c in choices_of((await http.post(route, json=body)).text) if "role" not in c.get("delta", {})]
    async with app_client(tokenizer, ScriptedMesh(ids + [tokenizer.eos_token_id], FinishReason.STOP)) as http:
        eos = [c for c in choices_of((await http.post(route, json={**body, "stop": None, "max_tokens": 32})).text)
               if "role" not in c.get("delta", {})]
    assert (text_of(kept[-1]), kept[-1]["finish_reason"], kept[-1]["stop_reason"]) == (".", "stop", ".")
    assert "".join(text_of(c) for c in kept) == "The answer is 42."
    assert [c["finish_reason"] for c in kept[:-1]] == [None] * (len(kept) - 1)
    assert (text_of(eos[-1]), eos[-1]["finish_reason"]) == ("", "stop")  # the EOS: a token of no text
    assert len(eos) == len(ids) + 1 and "".join(text_of(c) for c in eos) == OUTPUT
