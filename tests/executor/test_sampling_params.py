"""Sampling parameters end to end inside the executor: validation (field and cap in
every message), the proto round trip, stop conditions with min_tokens and several
EOS ids, and, on the default model, repetition penalty against transformers'
``generate``, logprobs and prompt logprobs against transformers' float32 logits,
and min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from executor.engine.request import Request, RequestStatus
from executor.engine.stop import check_stop
from meshserve.errors import InvalidArgument
from meshserve.sampling import MAX_LOGPROBS, MAX_N, SamplingParams, from_proto, params_from_proto, to_proto, validate
from meshserve.v1 import common_pb2

VOCAB = 1000


def check(**kwargs) -> SamplingParams:
    return validate(SamplingParams(**kwargs), max_model_len=100, vocab_size=VOCAB)


@pytest.mark.parametrize("kwargs, needles", [
    (dict(min_p=-0.1), ["min_p", "[0, 1]"]),
    (dict(min_p=1.5), ["min_p"]),
    (dict(min_p=math.nan), ["min_p"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty", "> 0"]),
    (dict(repetition_penalty=-1.0), ["repetition_penalty"]),
    (dict(repetition_penalty=math.inf), ["repetition_penalty"]),
    (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=-2.01), ["frequency_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=math.nan), ["frequency_penalty"]),
    (dict(min_tokens=-1), ["min_tokens"]),
    (dict(max_tokens=8, min_tokens=9), ["min_tokens", "max_tokens=8"]),
    (dict(n=0), ["n must be in [1, 16]"]),
    (dict(n=MAX_N + 1), ["n must be in [1, 16]"]),
    (dict(logprobs=MAX_LOGPROBS + 1), ["logprobs", "20", "MAX_LOGPROBS"]),
    (dict(logprobs=-1), ["logprobs", "20"]),
    (dict(logprobs=VOCAB), ["logprobs", "20"]),
    (dict(prompt_logprobs=21), ["prompt_logprobs", "20"]),
    (dict(seed=1 << 63), ["seed must be in [-9223372036854775808, 9223372036854775807 - (n - 1)]"]),
    (dict(seed=-(1 << 63) - 1), ["seed must be in"]),
    (dict(seed=(1 << 63) - 1, n=2), ["seed must be in", "got 9223372036854775807"]),  # choice 1: seed + 1
    (dict(stop=("\ud800",)), ["stop strings must be valid Unicode (no lone surrogates)"]),
    (dict(logit_bias=((VOCAB, 1.0),)),
     ["logit_bias[1000]: token id 1000 is outside the vocabulary [0, 1000)"]),
    (dict(logit_bias=((-1, 1.0),)), ["logit_bias[-1]: token id -1 is outside the vocabulary [0, 1000)"]),
    (dict(logit_bias=((5, 100.5),)), ["logit_bias[5] must be in [-100, 100], got 100.5"]),
    (dict(logit_bias=((5, -101.0),)), ["logit_bias[5] must be in [-100, 100], got -101.0"]),
    (dict(logit_bias=((5, math.nan),)), ["logit_bias[5] must be in [-100, 100], got nan"]),
    (dict(logit_bias=((5, math.inf),)), ["logit_bias[5] must be in [-100, 100], got inf"]),
    (dict(logit_bias=((5, 1e39),)), ["logit_bias[5] must be in [-100, 100], got 1e+39 (inf as a float32)"]),
    (dict(logit_bias=((5, 1.0), (5, 2.0))), ["logit_bias[5]: token id 5 is given twice"]),
    (dict(logit_bias=tuple((i, 1.0) for i in range(301))), ["logit_bias takes at most 300 entries, got 301"]),
])
def test_invalid_values_name_the_field_and_the_limit(kwargs, needles):
    with pytest.raises(InvalidArgument) as info:
        check(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


def test_valid_edges_pass():
    for kwargs in (dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=1e-3), dict(presence_penalty=-2.0),
                   dict(frequency_penalty=2.0), dict(max_tokens=8, min_tokens=8), dict(n=1), dict(n=MAX_N),
                   dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(prompt_logprobs=0),
                   dict(seed=(1 << 63) - 1), dict(seed=-(1 << 63)), dict(seed=(1 << 63) - 2, n=2),
                   dict(stop=("é😀",)), dict(logit_bias=((0, -100.0), (VOCAB - 1, 100.0))),
                   dict(logit_bias=tuple((i, 0.5) for i in range(300)))):
        check(**kwargs)


def test_validate_sorts_logit_bias_by_token_id():
    assert check(logit_bias=((9, 1.0), (3, -2.0))).logit_bias == ((3, -2.0), (9, 1.0))
    params = check(logit_bias=((3, -2.0), (9, 1.0)))
    assert check(logit_bias=()).logit_bias == ()
    assert validate(params, max_model_len=100, vocab_size=VOCAB) is params  # nothing to normalise: as it was


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=1e39), "temperature must be a finite number >= 0, got 1e+39 (inf as a float32)"),
    (dict(top_p=1e-50), "top_p must be in (0, 1], got 1e-50 (0.0 as a float32)"),
    (dict(repetition_penalty=1e308),
     "repetition_penalty must be a finite number > 0 (1 is off), got 1e+308 (inf as a float32)"),
    (dict(repetition_penalty=1e-50), "repetition_penalty must be a finite number > 0 (1 is off), got 1e-50 "
                                     "(0.0 as a float32)"),
])
def test_a_value_valid_only_in_float64_is_refused_as_the_wire_would_carry_it(kwargs, message):
    """The gateway validates what the executor receives: float fields travel as float32."""
    with pytest.raises(InvalidArgument) as info:
        check(**kwargs)
    assert str(info.value) == message
    msg = common_pb2.SamplingParams()
    to_proto(SamplingParams(**kwargs), msg)
    with pytest.raises(InvalidArgument):  # what the executor would have said, after admission
        from_proto(msg, max_model_len=100, vocab_size=VOCAB)


def test_proto_round_trip_keeps_every_field_and_defaults():
    params = SamplingParams(max_tokens=20, temperature=0.5, seed=3, min_p=0.25, repetition_penalty=1.5,
                            presence_penalty=-0.5, frequency_penalty=1.25, min_tokens=4, n=3, logprobs=0,
                            prompt_logprobs=7, stop_token_ids=(5,), logit_bias=((3, -100.0), (9, 0.5)))
    msg = common_pb2.SamplingParams()
    to_proto(params, msg)
    assert dict(msg.logit_bias) == {3: -100.0, 9: 0.5}
    assert from_proto(msg, max_model_len=100, vocab_size=VOCAB) == params
    defaults = from_proto(common_pb2.SamplingParams(), max_model_len=100, vocab_size=VOCAB)
    assert (defaults.repetition_penalty, defaults.n, defaults.logprobs, defaults.prompt_logprobs) == \
        (1.0, 1, None, None)
    assert not defaults.has_penalties and defaults.logit_bias == ()
    msg = common_pb2.SamplingParams()
    to_proto(defaults, msg)
    assert not msg.HasField("logprobs") and not msg.HasField("prompt_logprobs")


def test_params_from_proto_builds_without_validating_and_from_proto_validates_once():
    """The executor builds params with ``params_from_proto`` and validates them in its one
    check (``LLMEngine.check_request``); ``from_proto`` (the gateway's) is the same build
    plus ``validate``, with the same message."""
    msg = common_pb2.SamplingParams(top_p=0.0, top_k=-1, n=2)
    raw = params_from_proto(msg)
    assert (raw.top_p, raw.top_k, raw.n, raw.max_tokens) == (0.0, -1, 2, 16)
    with pytest.raises(InvalidArgument, match=r"top_p must be in \(0, 1\], got 0.0") as from_gateway:
        from_proto(msg, max_model_len=100, vocab_size=VOCAB)
    with pytest.raises(InvalidArgument) as direct:
        validate(raw, max_model_len=100, vocab_size=VOCAB)
    assert str(from_gateway.value) == str(direct.value)
    msg.top_p = 0.5
    assert from_proto(msg, max_model_len=100, vocab_size=VOCAB) == validate(params_from_proto(msg), max_model_len=100,
                                                                             vocab_size=VOCAB)


def test_for_choice_offsets_the_seed_and_keeps_prompt_logprobs_on_choice_0():
    p = SamplingParams(n=4, seed=10, prompt_logprobs=2, logprobs=1)
    assert [p.for_choice(i).seed for i in range(4)] == [10, 11, 12, 13]
    assert [p.for_choice(i).prompt_logprobs for i in range(4)] == [2, None, None, None]
    assert {p.for_choice(i).logprobs for i in range(4)} == {1}
    assert SamplingParams(n=2).for_choice(1).seed is None


def request_with(outputs: list[int], **params) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, **params), 0, 0, 10_000)
    for t in outputs:
        r.append_output(t)
    return r


def test_ignore_eos_ignores_every_model_eos_id_but_never_stop_token_ids():
    eos = frozenset({2, 9})
    for token in (2, 9):
        assert check_stop(request_with([token]), eos) == RequestStatus.FINISHED_STOPPED
        assert check_stop(request_with([token], ignore_eos=True), eos) is None
    assert check_stop(request_with([5], ignore_eos=True, stop_token_ids=(5,)), eos) == RequestStatus.FINISHED_STOPPED
    assert check_stop(request_with([2], ignore_eos=True, stop_token_ids=(2,)), eos) == RequestStatus.FINISHED_STOPPED


def test_min_tokens_never_stops_on_eos_or_stop_ids_before_it_is_reached():
    eos = frozenset({2, 9})
    for outputs in ([2], [4, 9], [4, 4, 5]):  # 1, 2, 3 outputs <= min_tokens 3
        assert check_stop(request_with(outputs, min_tokens=3, stop_token_ids=(5,)), eos) is None
    assert check_stop(request_with([4, 4, 4, 9], min_tokens=3), eos) == RequestStatus.FINISHED_STOPPED
    assert check_stop(request_with([4, 4, 4, 5], min_tokens=3, stop_token_ids=(5,)), eos) == \
        RequestStatus.FINISHED_STOPPED
    capped = request_with([2] * 10, min_tokens=10)
    assert check_stop(capped, eos) == RequestStatus.FINISHED_LENGTH_CAPPED  # max_tokens still applies


# -- on the default model --------------------------------------------------------------

REP_PROMPTS = ("The cat sat on the mat. The cat sat on the mat. The cat",
               "List the numbers: one, two, three, one, two, three, one,")


@pytest.fixture(scope="module")
def hf_model(default_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model.path), dtype=torch.float32).eval()


def hf_greedy_with_repetition_penalty(model, prompt: list[int], max_new_tokens: int, penalty: float):
    """transformers' greedy ``generate`` with its ``RepetitionPenaltyLogitsProcessor``
    (penalises prompt + output tokens, CTRL-style); top-2 of the processed scores."""
    from tests.support.reference import ReferenceOutput

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, repetition_penalty=penalty, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    top = [s[0].float().topk(2) for s in out.scores]
    return ReferenceOutput(out.sequences[0, len(prompt):].tolist(), [tuple(t.indices.tolist()) for t in top],
                           [tuple(t.values.tolist()) for t in top])


@pytest.mark.model
def test_greedy_repetition_penalty_equals_transformers(engine, tokenizer, default_model, hf_model):
    from tests.support.reference import assert_greedy_matches, cached_reference

    prompts = [tokenizer(p).input_ids for p in REP_PROMPTS]
    outputs = {}
    for penalty in (1.3, 0.9):
        key = {"model": default_model.model_id, "revision": default_model.revision, "prompts": prompts,
               "max_new_tokens": 24, "repetition_penalty": penalty}
        refs = cached_reference(key, lambda: [hf_greedy_with_repetition_penalty(hf_model, p, 24, penalty)
                                              for p in prompts])
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
        outputs[penalty] = engine.generate(prompts, params)
        assert_greedy_matches(outputs[penalty], refs, max_divergent=0)
    assert outputs[1.3] != outputs[0.9]  # the penalty does change the greedy path on these prompts


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``(len(ids), vocab)`` log_softmax of transformers' float32 logits; row j predicts ids[j + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_entry(entry, ref_row: torch.Tensor, token: int, k: int, tol: float = 1e-4) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(ref_row[token].item(), abs=tol)
    assert len(entry.top_token_ids) == len(entry.top_logprobs) == k
    assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
    assert all(v <= 0 for v in entry.top_logprobs)
    for t, v in zip(entry.top_token_ids, entry.top_logprobs):
        assert v == pytest.approx(ref_row[t].item(), abs=tol)
    if k:  # the k-th best of the reference, as a value (ties may order ids differently)
        assert entry.top_logprobs[-1] == pytest.approx(ref_row.topk(k).values[-1].item(), abs=tol)


def run_requests(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


@pytest.mark.model
def test_logprobs_and_prompt_logprobs_equal_transformers(engine, tokenizer, hf_model):
    """Sampled (seeded, with penalties and temperature: logprobs stay raw) and greedy
    requests batched together; a 600-token prompt is prefilled in two chunks (budget
    512) and its prompt logprobs are computed 256 rows at a time."""
    short = tokenizer("Paged attention stores keys and values in blocks.").input_ids
    long = (tokenizer(" ".join(["The library opens at nine and closes at six."] * 60)).input_ids)[:600]
    requests = {
        "sampled": (short, SamplingParams(max_tokens=8, temperature=0.8, seed=5, repetition_penalty=1.5,
                                          presence_penalty=0.5, logprobs=MAX_LOGPROBS, prompt_logprobs=5,
                                          ignore_eos=True)),
        "greedy": (long, SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=MAX_LOGPROBS,
                                        ignore_eos=True)),
        "plain": (short, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
    }
    outs = run_requests(engine, requests)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs["plain"])
    for rid, k, pk in (("sampled", MAX_LOGPROBS, 5), ("greedy", 0, MAX_LOGPROBS)):
        prompt = requests[rid][0]
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        ref = hf_logprobs(hf_model, prompt + tokens)
        prompt_lps = outs[rid][0].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outs[rid][1:])  # once, with the first token
        assert len(prompt_lps) == len(prompt) - 1
        for j, entry in enumerate(prompt_lps):  # position j + 1
            assert_entry(entry, ref[j], prompt[j + 1], pk)
        lps = [lp for o in outs[rid] for lp in o.logprobs]
        assert len(lps) == len(tokens)
        for i, (entry, token) in enumerate(zip(lps, tokens)):
            assert_entry(entry, ref[len(prompt) - 1 + i], token, k)
    engine.check_integrity()


@pytest.mark.model
def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(engine, tokenizer):
    """prompt_logprobs 0 (the prompt tokens' own logprobs, no top) needs every position
    too: a prompt already in the prefix cache must be computed again."""
    prompt = tokenizer(" ".join(["Rain fell softly on the old tin roof."] * 12)).input_ids
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # caches it
    for k in (0, 3):
        outs = run_requests(engine, {f"cached-{k}": (prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                         prompt_logprobs=k, ignore_eos=True))})
        lps = outs[f"cached-{k}"][0].prompt_logprobs
        assert [e.token_id for e in lps] == prompt[1:]
        assert all(len(e.top_token_ids) == k and e.logprob <= 0 for e in lps)


@pytest.mark.model
def test_min_tokens_keeps_eos_away_until_reached(engine, tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say OK."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(chat, add_special_tokens=False).input_ids
    eos = sorted(engine.eos_token_ids)
    [free] = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))
    assert free[-1] in eos and len(free) < 32  # the model ends early on its own
    min_tokens = len(free) + 4
    [held] = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=min_tokens))
    assert not set(held[:min_tokens]) & set(eos)
    assert held[: len(free) - 1] == free[:-1]  # identical up to where EOS was masked
    assert len(held) > min_tokens
    # a stop token id is masked the same way, and ignore_eos does not unmask it
    stop_id = free[0]
    [first] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_id,)))
    assert first == [stop_id]
    [later] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_id,),
                                                    min_tokens=3, ignore_eos=True))
    assert stop_id not in later[:3]
