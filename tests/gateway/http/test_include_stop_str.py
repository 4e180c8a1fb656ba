"""vLLM's ``include_stop_str_in_output``: a choice a stop string ended keeps that string
at the end of its text (cut right after it, even inside a token), streamed and not
alike, in chat and completions, for every choice; without it the text ends right
before it. ``POST /v1/tasks`` carries it: the task's text is the same."""

from __future__ import annotations

import json

import pytest

from tests.support.inprocess_app import ScriptedMesh, app_client, finished_task

CHAT = [{"role": "user", "content": "Hi"}]
OUTPUT = "The answer is 42. Done here"  # tokens: The| answer| is| |4|2|.| Done| here


def texts_of(route: str, body: dict) -> list[str]:
    """Each choice's full text of a non-streamed response."""
    return [c["message"]["content"] if route.endswith("chat/completions") else c["text"] for c in body["choices"]]


def streamed_texts(route: str, events: str) -> tuple[list[str], list[dict]]:
    """Each choice's text joined from a stream's chunks, and the chunks with a finish reason."""
    texts: dict[int, str] = {}
    finished = []
    for line in events.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:])["choices"]:
            piece = c.get("delta", {}).get("content") if route.endswith("chat/completions") else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"]:
                finished.append(c)
    return [texts[i] for i in sorted(texts)], finished


@pytest.mark.parametrize("route, prompt", [("/v1/chat/completions", {"messages": CHAT}),
                                           ("/v1/completions", {"prompt": "Q:"})])
@pytest.mark.parametrize("stop, include, want", [
    (["."], True, "The answer is 42."),
    (["."], False, "The answer is 42"),
    (["swer", "."], True, "The answer"),  # ends inside the token " answer"
    (["swer"], False, "The an"),
    (["nowhere"], True, OUTPUT),  # no stop string matched: nothing is added
])
async def test_the_stop_string_stays_when_asked_streamed_or_not(tokenizer, route, prompt, stop, include, want):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    body = {**prompt, "stop": stop, "n": 2, "max_tokens": 9, "include_stop_str_in_output": include}
    async with app_client(tokenizer, mesh) as http:
        full = await http.post(route, json=body)
        streamed = await http.post(route, json={**body, "stream": True})
    assert full.status_code == streamed.status_code == 200
    assert texts_of(route, full.json()) == [want, want]
    texts, finished = streamed_texts(route, streamed.text)
    assert texts == [want, want]
    matched = stop[0] if want != OUTPUT else None
    assert [(c["finish_reason"], c["stop_reason"]) for c in finished] == [
        ("stop" if matched else "length", matched)] * 2
    assert [c["finish_reason"] for c in full.json()["choices"]] == ["stop" if matched else "length"] * 2


@pytest.mark.parametrize("body", [{"messages": CHAT}, {"prompt": "Q:"}])
@pytest.mark.parametrize("include, want", [(True, "The answer is 42."), (False, "The answer is 42")])
async def test_a_tasks_text_keeps_it_when_asked(tokenizer, body, include, want):
    mesh = ScriptedMesh(tokenizer.encode(OUTPUT, add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        status = await finished_task(http, {**body, "stop": ["."], "max_tokens": 9,
                                            "include_stop_str_in_output": include})
    assert status["state"] == "TASK_STATE_SUCCEEDED"
    (choice,) = status["choices"]
    assert (choice["text"], choice["result"]["stop_reason"], len(choice["token_ids"])) == (want, ".", 7)
