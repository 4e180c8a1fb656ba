"""``meshserve generate --json`` with several prompts: each line names the prompt it
answers (``prompt_index``: its ``--prompt``, from 0) beside the choice's ``index``,
also a failed prompt's error line; the lines come in the prompts' order. The gateway
calls are faked (``generate_choices``): what is tested is what the command prints."""

from __future__ import annotations

import json

import grpc
from typer.testing import CliRunner

import meshserve.client
from meshserve.cli import app
from meshserve.client import Completion
from tests.support.generate_requests import recording_requests


async def fake_generate_choices(stub, request, metadata=(), timeout=None, on_delta=None) -> list[Completion]:
    """Choice i of prompt P answers ``P #i``; the prompt ``fail`` is refused (UNAVAILABLE)."""
    if request.prompt == "fail":
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="no executor")
    return [Completion(index=i, text=f"{request.prompt} #{i}", finish_reason="length")
            for i in range(request.sampling.n or 1)]


def run_generate(monkeypatch, *args: str):
    monkeypatch.setattr(meshserve.client, "generate_choices", fake_generate_choices)
    monkeypatch.delenv("MESHSERVE_API_KEY", raising=False)
    return CliRunner().invoke(app, ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", *args])


def test_each_line_names_its_prompt_and_its_choice(monkeypatch):
    result = run_generate(monkeypatch, "--prompt", "sky", "--prompt", "sea", "--prompt", "sun", "--n", "2")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["prompt_index"], line["index"], line["text"]) for line in lines] == [
        (0, 0, "sky #0"), (0, 1, "sky #1"), (1, 0, "sea #0"), (1, 1, "sea #1"), (2, 0, "sun #0"), (2, 1, "sun #1")]
    assert list(lines[0])[:2] == ["prompt_index", "index"]
    assert (lines[0]["stop_reason"], lines[0]["stop_token_id"]) == (None, None)  # null when nothing matched


def test_the_stop_string_that_ended_a_choice_is_its_stop_reason(monkeypatch):
    async def stopped(stub, request, metadata=(), timeout=None, on_delta=None) -> list[Completion]:
        return [Completion(index=0, text="Paris", finish_reason="stop", stop_reason=".")]

    monkeypatch.setattr(meshserve.client, "generate_choices", stopped)
    monkeypatch.delenv("MESHSERVE_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", "--prompt", "x"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert (line["finish_reason"], line["stop_reason"], line["stop_token_id"]) == ("stop", ".", None)


def test_one_prompt_is_prompt_0_and_a_failed_prompt_is_named_by_its_index(monkeypatch):
    result = run_generate(monkeypatch, "--prompt", "sky")
    assert result.exit_code == 0 and json.loads(result.stdout)["prompt_index"] == 0
    result = run_generate(monkeypatch, "--prompt", "sky", "--prompt", "fail", "--prompt", "sun")
    assert result.exit_code == 1
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[1] == {"prompt_index": 1, "error": {"code": "UNAVAILABLE", "message": "no executor"}}
    assert [(line["prompt_index"], line["text"]) for line in (lines[0], lines[2])] == [(0, "sky #0"), (2, "sun #0")]


def test_stop_token_ids_include_stop_str_and_cache_salt_reach_the_request(monkeypatch):
    sent = recording_requests(monkeypatch)
    result = CliRunner().invoke(app, ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", "--prompt", "sky",
                                      "--stop-token-id", "30", "--stop-token-id", "13",
                                      "--include-stop-str-in-output", "--cache-salt", "user-42"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", "--prompt", "sky"])
    assert result.exit_code == 0, result.output
    salted, plain = sent
    assert (list(salted.sampling.stop_token_ids), salted.include_stop_str_in_output, salted.cache_salt) == (
        [30, 13], True, "user-42")
    assert (list(plain.sampling.stop_token_ids), plain.include_stop_str_in_output, plain.HasField("cache_salt")) == (
        [], False, False)


def test_logit_bias_options_reach_the_request_and_a_malformed_one_is_a_usage_error(monkeypatch):
    sent = recording_requests(monkeypatch)
    base = ["generate", "--addr", "127.0.0.1:1", "--insecure", "--json", "--prompt", "sky"]
    result = CliRunner().invoke(app, [*base, "--logit-bias", "4528=100", "--logit-bias", "7042=-2.5"])
    assert result.exit_code == 0, result.output
    assert dict(sent[0].sampling.logit_bias) == {4528: 100.0, 7042: -2.5}
    for bad, message in (("4528", "'4528' is not ID=BIAS"), ("x=1", "'x=1' is not ID=BIAS"),
                         ("5=big", "'5=big' is not ID=BIAS")):
        result = CliRunner().invoke(app, [*base, "--logit-bias", bad])
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(app, [*base, "--logit-bias", "5=1", "--logit-bias", "5=2"])
    assert result.exit_code == 2 and "token id 5 is given twice" in result.output
    assert len(sent) == 1  # nothing sent for a usage error
