"""A stop token (one of ``stop_token_ids``) with and without ``include_stop_str_in_output``,
as vLLM's detokenizer: without, neither its text nor the start of a character it completes
is output; with, its text is kept, whole characters, cut after the first stop string it
completes (then that string is the ``stop_reason``). Both from one result-cache entry."""

from __future__ import annotations

from contextlib import aclosing

from gateway.choices import split_stop_token
from gateway.events import ChoiceResult, Delta, FinishReason
from gateway.generation import GatewayCore
from gateway.request import GenerationRequest
from gateway.result_cache import ResultCache
from gateway.tenants import Tenant
from meshserve.sampling import SamplingParams
from tests.support.inprocess_app import MODEL, ScriptedMesh

TENANT = Tenant("acme")


class StopMesh(ScriptedMesh):
    """A ``ScriptedMesh`` whose choices end "stop" on their last token, as an engine's stop token."""

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        async for out in super().execute(assignment, request_id, prompt_token_ids, params, priority, span,
                                         cache_salt):
            yield out if out.finish_reason is None else type(out)(out.index, out.token_ids, FinishReason.STOP)


async def events_of(core: GatewayCore, include: bool, stop_id: int, stop: tuple[str, ...] = ()) -> list:
    sampling = SamplingParams(temperature=0.0, max_tokens=16, stop=stop, stop_token_ids=[stop_id])
    request = GenerationRequest(prompt="Q:", sampling=sampling, include_stop_str_in_output=include)
    async with aclosing(core.generate(request, TENANT)) as events:
        return [e async for e in events]


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_a_stop_token_completing_a_character_keeps_the_character_or_leaves_all_of_it_out(tokenizer):
    ids = tokenizer.encode("Hi 🚀", add_special_tokens=False)  # the rocket's last byte is a token of its own
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    mesh = StopMesh(ids)
    core = GatewayCore(tokenizer, MODEL, mesh, result_cache=ResultCache(8, ttl_s=60.0))
    try:
        kept = await events_of(core, True, ids[-1])
        cut = await events_of(core, False, ids[-1])  # the result cache answers
        kept_again = await events_of(core, True, ids[-1])
    finally:
        await core.close()
    assert len(mesh.prompts) == 1
    assert [text_of(kept), text_of(cut), text_of(kept_again)] == ["Hi 🚀", "Hi ", "Hi 🚀"]
    assert kept[-2] == Delta(0, "🚀", (), last=True) and kept_again[-1].cached
    for events in (kept, cut, kept_again):
        assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == ids
        assert events[-1].usage.completion_tokens == len(ids) and events[-1].stop_reason == ""


async def test_a_stop_token_first_and_alone_is_its_own_text_when_kept(tokenizer):
    ids = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(ids) == 1
    core = GatewayCore(tokenizer, MODEL, StopMesh(ids))
    try:
        assert text_of(await events_of(core, True, ids[0])) == " Paris"
        assert text_of(await events_of(core, False, ids[0])) == ""
    finally:
        await core.close()


async def test_a_stop_string_the_kept_stop_token_completes_cuts_its_text_there(tokenizer):
    ids = tokenizer.encode(" 中文\n- English", add_special_tokens=False)
    assert tokenizer.decode(ids[-1:]) == " English"
    core = GatewayCore(tokenizer, MODEL, StopMesh(ids))
    try:
        inside = await events_of(core, True, ids[-1], stop=("Eng",))
        across = await events_of(core, True, ids[-1], stop=("- Eng", "Engl"))  # begins before the token
        cut = await events_of(core, False, ids[-1], stop=("Eng",))
    finally:
        await core.close()
    assert (text_of(inside), inside[-1].stop_reason) == (" 中文\n- Eng", "Eng")
    assert (text_of(across), across[-1].stop_reason) == (" 中文\n- Eng", "- Eng")
    assert (text_of(cut), cut[-1].stop_reason) == (" 中文\n-", "")
    assert isinstance(inside[-1], ChoiceResult) and inside[-1].finish_reason == FinishReason.STOP
    # the stop string is the reason then (vLLM's stop_reason), not the stop token's id
    assert [inside[-1].stop_token_id, across[-1].stop_token_id, cut[-1].stop_token_id] == [None, None, ids[-1]]


class SpacesCleanedUp:
    """The default model's tokenizer with a decoder that cleans up spaces (``" '"`` → ``"'"``),
    as some tokenizers' ``clean_up_tokenization_spaces`` does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).replace(" '", "'")

    def convert_ids_to_tokens(self, token_id):
        return self.tokenizer.convert_ids_to_tokens(token_id)


def test_a_stop_token_that_changes_earlier_text_otherwise_than_completing_a_character_cuts_nothing(tokenizer):
    ids = tokenizer.encode("x 's", add_special_tokens=False)
    assert split_stop_token(SpacesCleanedUp(tokenizer), ids) == (0, "s")
    assert split_stop_token(tokenizer, tokenizer.encode("Hi 🚀", add_special_tokens=False)) == (1, "🚀")
