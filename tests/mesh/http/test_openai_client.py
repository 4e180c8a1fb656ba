"""The OpenAI-compatible HTTP API through the official ``openai`` client, sync and
async, streamed and not, chat and completions, against the gRPC path of the same
mesh: greedy text equal, usage exact, n choices with their indices, stop strings,
logprobs (cases C28, C29, C30).

The sync client blocks: it runs in a thread (``asyncio.to_thread``) while the mesh
serves in the test's event loop."""

import asyncio
from collections import defaultdict

import openai
import pytest

from meshserve.client import build_request, generate
from tests.support.http_mesh import KEY_A, SERVED

pytestmark = pytest.mark.model
GRPC_KEY = (("x-api-key", KEY_A),)
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
def client(http_mesh):
    return openai.OpenAI(base_url=f"{http_mesh.http_url}/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture
def aclient(http_mesh):
    return openai.AsyncOpenAI(base_url=f"{http_mesh.http_url}/v1", api_key=KEY_A, max_retries=0)


async def _grpc_chat(mesh, messages, **kw):
    chat = [(m["role"], m["content"]) for m in messages]
    return await generate(mesh.stub, build_request(chat=chat, **kw), GRPC_KEY)


async def test_models_lists_the_served_name(client, aclient):
    models = await asyncio.to_thread(client.models.list)
    assert [m.id for m in models.data] == [SERVED]
    assert [m.id async for m in aclient.models.list()] == [SERVED]


async def test_sync_chat_greedy_text_and_usage_equal_the_grpc_path(http_mesh, client):
    ref = await _grpc_chat(http_mesh, CHAT, max_tokens=24, temperature=0)
    out = await asyncio.to_thread(client.chat.completions.create, model=SERVED, messages=CHAT, max_tokens=24,
                                  temperature=0)
    assert out.object == "chat.completion" and out.model == SERVED
    [choice] = out.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)


async def test_async_streamed_chat_equals_the_grpc_path_with_usage_last(http_mesh, aclient):
    ref = await _grpc_chat(http_mesh, CHAT, max_tokens=24, temperature=0)
    stream = await aclient.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" and c.model == SERVED for c in chunks)
    assert all(c.usage is None for c in chunks[:-1])
    *body, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert last.usage.completion_tokens == len(ref.token_ids)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    finished = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finished == [ref.finish_reason] and body[-1].choices[0].finish_reason == ref.finish_reason


async def test_sync_streamed_completion_equals_the_grpc_path(http_mesh, client):
    prompt = "The three primary colors are"
    ref = await generate(http_mesh.stub, build_request(prompt, max_tokens=20, temperature=0), GRPC_KEY)

    def run():
        return list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=20, temperature=0,
                                              stream=True))
    chunks = await asyncio.to_thread(run)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [ref.finish_reason]


async def test_async_completion_of_token_ids_equals_the_grpc_path(http_mesh, aclient, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    ref = await generate(http_mesh.stub, build_request(ids, max_tokens=12, temperature=0), GRPC_KEY)
    out = await aclient.completions.create(model=SERVED, prompt=ids, max_tokens=12, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref.token_ids)


async def test_ignore_eos_gives_exactly_max_tokens(aclient):
    out = await aclient.completions.create(model=SERVED, prompt="Hi", max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40 and out.choices[0].finish_reason == "length"


def _by_index(chunks):
    texts, finishes, roles, after_finish = defaultdict(str), defaultdict(list), defaultdict(int), []
    for c in chunks:
        for ch in c.choices:
            if ch.index in finishes and finishes[ch.index]:
                after_finish.append(ch)
            if getattr(ch, "delta", None) is not None:
                roles[ch.index] += ch.delta.role == "assistant"
                texts[ch.index] += ch.delta.content or ""
            else:
                texts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    return texts, finishes, roles, after_finish


async def test_n3_streamed_choices_match_the_unstreamed_ones_index_for_index(aclient):
    """Case C28: chat n=3, temperature 1.0, seed 11, max_tokens 24, streamed and not:
    indices in {0,1,2}, deltas by index concatenate to the unstreamed texts, one
    finish chunk per index and nothing after it, the role announced once per index."""
    kw = dict(model=SERVED, messages=[{"role": "user", "content": "Name a color and a fruit."}], n=3,
              temperature=1.0, seed=11, max_tokens=24)
    full = await aclient.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    stream = await aclient.chat.completions.create(**kw, stream=True)
    texts, finishes, roles, after = _by_index([c async for c in stream])
    assert set(texts) == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert [finishes[i] for i in range(3)] == [[c.finish_reason] for c in full.choices]
    assert dict(roles) == {0: 1, 1: 1, 2: 1} and after == []


async def test_completions_of_two_prompts_with_n2_index_i_belongs_to_prompt_i_div_n(aclient):
    """Case C28: /v1/completions with 2 prompts and n=2, streamed: indices 0..3, index
    i is choice i % n of prompt i // n (equal to that prompt's own seeded request)."""
    prompts = ["The sky is", "My favourite food is"]
    kw = dict(model=SERVED, n=2, temperature=1.0, seed=5, max_tokens=12)
    stream = await aclient.completions.create(prompt=prompts, stream=True, **kw)
    texts, finishes, _, after = _by_index([c async for c in stream])
    assert sorted(texts) == [0, 1, 2, 3] and after == []
    assert all(len(finishes[i]) == 1 for i in range(4))
    for p, prompt in enumerate(prompts):
        alone = await aclient.completions.create(prompt=prompt, **kw)
        assert [texts[p * 2 + c.index] for c in alone.choices] == [c.text for c in alone.choices]


async def test_stop_string_cuts_the_text_and_names_itself(http_mesh, aclient):
    ref = await _grpc_chat(http_mesh, CHAT, max_tokens=24, temperature=0, ignore_eos=True)
    words = ref.text.split()
    stop = words[len(words) // 2]
    expected = ref.text[:ref.text.index(stop)]
    out = await aclient.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=24, temperature=0,
                                                stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.content == expected
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    stream = await aclient.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=24, temperature=0,
                                                   stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == expected


async def test_streamed_logprobs_concatenate_to_the_unstreamed_list(http_mesh, aclient):
    """Case C30: chat, temperature 0, max_tokens 64, logprobs with top_logprobs 5,
    with multi-byte output: the streamed entries, concatenated, equal the unstreamed
    list (count == completion_tokens, same tokens and bytes, logprob within 1e-6,
    the same 5 alternatives in order); each chunk covers its delta's tokens."""
    messages = [{"role": "user", "content": "Translate to Chinese: good morning, Mr. Smith"}]
    kw = dict(model=SERVED, messages=messages, max_tokens=64, temperature=0, logprobs=True, top_logprobs=5)
    full = await aclient.chat.completions.create(**kw)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens
    assert all(len(e.top_logprobs) == 5 for e in entries)
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    ref = await _grpc_chat(http_mesh, messages, max_tokens=64, temperature=0, logprobs=5)
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-6)
    stream = await aclient.chat.completions.create(**kw, stream=True)
    streamed = []
    async for c in stream:
        if c.choices and c.choices[0].logprobs is not None:
            streamed.extend(c.choices[0].logprobs.content)
    assert len(streamed) == len(entries)
    for s, e in zip(streamed, entries):
        assert (s.token, s.bytes) == (e.token, e.bytes) and abs(s.logprob - e.logprob) <= 1e-6
        assert [(t.token, t.bytes) for t in s.top_logprobs] == [(t.token, t.bytes) for t in e.top_logprobs]
        assert [t.logprob for t in s.top_logprobs] == pytest.approx([t.logprob for t in e.top_logprobs], abs=1e-6)


async def test_completion_logprobs_shape(aclient):
    out = await aclient.completions.create(model=SERVED, prompt="The sky is", max_tokens=6, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


async def test_completion_prompt_logprobs_equal_the_grpc_path(http_mesh, client):
    """vLLM's ``prompt_logprobs`` (sent as the openai client sends extras): one entry per
    prompt token (null first), each position's prompt token and top 3 with the values
    gRPC ``Generate`` returns for the same request (each computed alone: exactly equal)."""
    prompt = "The capital of France is"
    ref = await generate(http_mesh.stub, build_request(prompt, max_tokens=1, temperature=0, prompt_logprobs=3),
                         GRPC_KEY)
    out = await asyncio.to_thread(client.completions.create, model=SERVED, prompt=prompt, max_tokens=1,
                                  temperature=0, extra_body={"prompt_logprobs": 3})
    entries = out.choices[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(ref.prompt_token_ids) == out.usage.prompt_tokens
    assert [int(next(iter(p))) for p in entries[1:]] == ref.prompt_token_ids[1:]
    for position, lp in zip(entries[1:], ref.prompt_logprobs, strict=True):
        assert position[str(lp.token_id)]["logprob"] == lp.logprob and lp.rank >= 1
        ranked = sorted((v["rank"], int(t), v["logprob"]) for t, v in position.items())
        top = [(r, t, v) for r, (t, v) in enumerate(lp.top, 1)]
        own = [] if any(t == lp.token_id for t, _ in lp.top) else [(lp.rank, lp.token_id, lp.logprob)]
        assert ranked == sorted(top + own)  # the top 3 at ranks 1-3, the prompt's own at its rank when not in them
    await http_mesh.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
async def test_either_token_cap_of_one_gives_one_token(http_mesh, aclient, stream):
    """Case C29: chat("Count from 1 to 50."), temperature 0: max_completion_tokens 1 or
    max_tokens 1 give exactly 1 token (finish "length", completion_tokens 1, the
    REF's first token); both set: max_completion_tokens wins."""
    messages = [{"role": "user", "content": "Count from 1 to 50."}]
    ref = await _grpc_chat(http_mesh, messages, max_tokens=1, temperature=0)
    for cap in ({"max_completion_tokens": 1}, {"max_tokens": 1}, {"max_completion_tokens": 1, "max_tokens": 50}):
        kw = dict(model=SERVED, messages=messages, temperature=0, **cap)
        if stream:
            chunks = [c async for c in await aclient.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True})]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            out = await aclient.chat.completions.create(**kw)
            text, reasons, usage = out.choices[0].message.content, [out.choices[0].finish_reason], out.usage
        assert (text, reasons, usage.completion_tokens) == (ref.text, ["length"], 1), cap
    out = await aclient.chat.completions.create(model=SERVED, messages=messages, temperature=0,
                                                max_completion_tokens=5, max_tokens=50)
    assert out.usage.completion_tokens == 5


async def test_no_token_cap_runs_to_the_end_of_the_answer(http_mesh, aclient):
    """Case C29: neither cap: the answer may run to the context (max_model_len); it
    ends by itself here, as the gRPC path's with the same cap."""
    messages = [{"role": "user", "content": "Say hi."}]
    ref = await _grpc_chat(http_mesh, messages, max_tokens=http_mesh.engines[0].max_model_len, temperature=0)
    out = await aclient.chat.completions.create(model=SERVED, messages=messages, temperature=0)
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("field,value", [("max_completion_tokens", 0), ("max_completion_tokens", -3),
                                         ("max_tokens", 0), ("max_tokens", -3)])
async def test_zero_or_negative_token_cap_is_400_naming_the_field(aclient, field, value):
    """Case C29: max_completion_tokens (or max_tokens) 0 or negative: 400 naming it."""
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(model=SERVED, messages=CHAT, **{field: value})
    assert err.value.status_code == 400 and err.value.body["param"] == field
