"""Structured outputs in the engine: greedy tokens equal transformers' ``generate`` with
xgrammar's own logits processor, the grammar survives preemption, ends the request
when complete, and a bad spec is refused before anything is queued."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.errors import InvalidArgument
from meshserve.sampling import SamplingParams
from meshserve.structured_output import StructuredOutput, json_spec
from tests.support.reference import ReferenceOutput, assert_greedy_matches, cached_reference

CAT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
SPECS = {
    "json": StructuredOutput("json", json_spec(CAT_SCHEMA)),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,5}"),
    "choice": StructuredOutput("choice", choices=("yes", "no", "maybe")),
    "grammar": StructuredOutput("grammar", 'root ::= "The answer is " ("red" | "blue") "."'),
}
QUESTIONS = {
    "json": "Give me a JSON object describing a cat with a name and an age.",
    "json_object": "Describe a dog as JSON.",
    "regex": "Make up a product code.",
    "choice": "Is the sky blue? Answer yes or no.",
    "grammar": "What colour is the sea?",
}
MAX_TOKENS = 48


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def xgrammar_reference(path, prompts: list[list[int]], specs: list[StructuredOutput],
                       vocab_size: int, eos: list[int]) -> list[ReferenceOutput]:
    """transformers' greedy ``generate`` (float32, one prompt at a time, stopping at EOS)
    with ``xgrammar.contrib.hf.LogitsProcessor``; top-2 of the masked scores."""
    import xgrammar
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshserve.structured_output import grammar

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=vocab_size,
                                                   stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    outputs = []
    for prompt, spec in zip(prompts, specs):
        processor = xgrammar.contrib.hf.LogitsProcessor(compiler.compile_grammar(grammar(spec)))
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, logits_processor=[processor], output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)
        top = [step[0].float().topk(2) for step in out.scores]
        outputs.append(ReferenceOutput(out.sequences[0, len(prompt):].tolist(),
                                       [tuple(t.indices.tolist()) for t in top],
                                       [tuple(t.values.tolist()) for t in top]))
    return outputs


def test_greedy_structured_outputs_equal_transformers_with_xgrammars_logits_processor(engine, tokenizer,
                                                                                      default_model):
    kinds = list(SPECS)
    prompts = [chat(tokenizer, QUESTIONS[k]) for k in kinds]
    specs = [SPECS[k] for k in kinds]
    eos = sorted(engine.eos_token_ids)
    key = {"test": "structured-output-greedy", "model": default_model.model_id, "revision": default_model.revision,
           "prompts": prompts, "specs": [s.key() for s in specs], "max_new_tokens": MAX_TOKENS, "eos": eos}
    refs = cached_reference(key, lambda: xgrammar_reference(default_model.path, prompts, specs,
                                                            engine.vocab_size, eos))
    ours = engine.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=s)
                                     for s in specs])
    assert_greedy_matches(ours, refs, max_divergent=0)
    texts = {k: tokenizer.decode(o, skip_special_tokens=True) for k, o in zip(kinds, ours)}
    assert all(o[-1] in engine.eos_token_ids for o in ours), "every constrained answer ends complete, with EOS"
    cat = json.loads(texts["json"])
    assert list(cat) == ["name", "age"], "properties come in the schema's order"
    assert isinstance(cat["name"], str) and isinstance(cat["age"], int)
    assert isinstance(json.loads(texts["json_object"]), dict)
    assert texts["choice"] in ("yes", "no", "maybe")
    assert texts["grammar"] in ("The answer is red.", "The answer is blue.")
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", texts["regex"])


def test_sampled_rows_only_draw_tokens_the_grammar_allows(engine, tokenizer):
    """Seeded sampling at temperature 1.5 over 8 seeds: every answer is one of the
    choices, and the same seed gives the same tokens alone or beside others."""
    spec = SPECS["choice"]
    prompt = chat(tokenizer, QUESTIONS["choice"])
    params = [SamplingParams(max_tokens=8, temperature=1.5, seed=s, structured_output=spec) for s in range(8)]
    together = engine.generate([prompt] * 8, params)
    for out in together:
        assert tokenizer.decode(out, skip_special_tokens=True) in spec.choices
        assert out[-1] in engine.eos_token_ids
    assert engine.generate([prompt], [params[3]]) == [together[3]]


def test_min_tokens_yields_to_a_complete_grammar(engine, tokenizer):
    """min_tokens masks EOS, but a complete grammar allows nothing else: the grammar's
    end wins, and the request ends "stop" right there, as with min_tokens 0."""
    prompt = chat(tokenizer, QUESTIONS["choice"])
    spec = SPECS["choice"]
    plain = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, structured_output=spec))
    held = engine.generate([prompt], SamplingParams(max_tokens=8, min_tokens=6, temperature=0.0,
                                                    structured_output=spec))
    assert held == plain
    assert plain[0][-1] in engine.eos_token_ids and len(plain[0]) < 6


def test_a_preempted_request_keeps_its_grammar_state(default_model, tokenizer):
    """Eight JSON requests on a cache too small for all of them: some are preempted
    (recompute) mid-answer, and every answer equals the one from a roomy cache."""
    def engine_with(num_blocks: int) -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=num_blocks, block_size=16),
                                      batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))

    prompts = [chat(tokenizer, f"Describe pet number {i} as JSON with a name and an age.") for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=SPECS["json"])
    roomy = engine_with(256)
    expected = roomy.generate(prompts, params)
    roomy.shutdown()
    tight = engine_with(24)
    got = tight.generate(prompts, params)
    assert tight.batch_scheduler.num_preemptions > 0
    assert got == expected
    assert tight.kv_cache_manager.num_free_blocks == 24  # every block back (cached ones count as free)
    tight.shutdown()


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json", '{"type": "foo"}'), 'structured output json: Unsupported type "foo"'),
    (StructuredOutput("regex", "[a-"), "structured output regex: Regex parsing error at position 4: Unclosed '['"),
    (StructuredOutput("grammar", "root ::= "), "structured output grammar: EBNF parser error"),
    (StructuredOutput("choice", choices=("yes", "")), "structured output choice strings must not be empty"),
])
def test_a_bad_spec_is_refused_before_anything_is_queued(engine, spec, message):
    with pytest.raises(InvalidArgument) as raised:
        engine.add_request("bad-spec", [1, 2, 3], SamplingParams(structured_output=spec))
    assert str(raised.value).startswith(message)
    assert not engine.has_unfinished_requests()


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path, default_model, caplog):
    """A safetensors folder with no tokenizer files: the request is INVALID_ARGUMENT."""
    import shutil

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(default_model.path / name, tmp_path / name)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", cache=CacheConfig(num_blocks=16)))
    try:
        with caplog.at_level(logging.WARNING, logger="executor.engine.structured_output"):
            eng.grammars.warm()  # a served executor's start-up: logged, not raised
        assert "structured outputs are refused on this executor" in caplog.text
        with pytest.raises(InvalidArgument, match="structured outputs need the model's tokenizer"):
            eng.add_request("r", [1, 2, 3], SamplingParams(structured_output=SPECS["choice"]))
        assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0)) != []
    finally:
        eng.shutdown()


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_the_samplers_mask_is_xgrammars_bitmask_applied_first(vocab):
    """Rows with a bitmask sample and take logprobs from the logits with xgrammar's
    ``apply_token_bitmask_inplace`` applied (a 1,024-token vocabulary takes the
    word-at-a-time path, with words all forbidden, all allowed and mixed; 1,000 the
    whole unpack); a row without one is untouched; min_tokens still masks EOS where
    the grammar allows more than the end."""
    import xgrammar

    from executor.worker.sampler import Sampler, SamplingBatch

    eos = 7
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=generator)
    words = torch.randint(-2**31, 2**31 - 1, (2, 32), dtype=torch.int32, generator=generator)
    words[:, 3:9] = 0
    words[:, 12:20] = -1
    words[0, 0] |= 1 << eos  # row 0 allows EOS, which its min_tokens masks
    reference = logits.clone()
    xgrammar.apply_token_bitmask_inplace(reference[:2], words)
    params = [SamplingParams(temperature=0.0, logprobs=2, min_tokens=1), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=2)]
    batch = SamplingBatch.build(params, [None] * 3, vocab, token_ids=[[1, 2], [1, 2], [1, 2]],
                                num_prompt_tokens=[2, 2, 2], eos_token_ids=frozenset({eos}),
                                grammar_bitmasks=[words[0].numpy().tobytes(), words[1].numpy().tobytes(), None])
    out = Sampler()(logits, batch)
    banned = reference.clone()
    banned[0, eos] = float("-inf")
    assert out.token_ids.tolist() == banned.argmax(dim=-1).tolist()
    expected = torch.log_softmax(reference, dim=-1)
    for row, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(expected[row, out.token_ids[row]].item(), abs=1e-6)
        assert list(entry.top_token_ids) == expected[row].topk(2).indices.tolist()
    allowed = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1).bool()
    assert allowed[0, out.token_ids[0]] and allowed[1, out.token_ids[1]]


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]])
@pytest.mark.parametrize("contiguous", [True, False])
def test_a_grammar_mask_sets_exactly_the_forbidden_tokens_to_minus_infinity(rows, contiguous):
    """``GrammarMask.apply`` equals xgrammar's ``apply_token_bitmask_inplace`` bit for bit,
    on every row or some, with words all zero, all one and mixed (4,100 tokens: the last
    word partly past the vocabulary); a non-contiguous tensor takes the torch path that
    other devices take."""
    import xgrammar

    from executor.worker.grammar_mask import GrammarMask

    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 4200 if not contiguous else 4100, generator=generator)[:, :4100]
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), 129), dtype=torch.int32, generator=generator)
    words[:, ::3] = 0
    words[:, 1::5] = -1
    expected = logits.clone()
    every_row = torch.full((3, 129), -1, dtype=torch.int32)  # xgrammar's indices pick rows of both
    every_row[rows] = words
    xgrammar.apply_token_bitmask_inplace(expected, every_row, indices=rows)
    bitmasks = [None] * 3
    for i, row in enumerate(rows):
        bitmasks[row] = words[i].numpy().tobytes()
    mask = GrammarMask.build(bitmasks)
    mask.apply(logits)
    assert torch.equal(logits, expected)


def test_min_tokens_gives_way_only_on_rows_whose_grammar_allows_nothing_else():
    """Row 0's grammar allows only EOS and min_tokens masks it: the row keeps its
    grammar's EOS; row 1 (no grammar) still has EOS masked."""
    from executor.worker.sampler import Sampler, SamplingBatch

    vocab, eos = 64, 3
    logits = torch.zeros(2, vocab)
    logits[:, eos] = 5.0
    only_eos = torch.zeros(2, dtype=torch.int32)
    only_eos[0] = 1 << eos
    params = [SamplingParams(temperature=0.0, min_tokens=4)] * 2
    batch = SamplingBatch.build(params, [None] * 2, vocab, token_ids=[[1], [1]], num_prompt_tokens=[1, 1],
                                eos_token_ids=frozenset({eos}), grammar_bitmasks=[only_eos.numpy().tobytes(), None])
    assert Sampler()(logits, batch).token_ids.tolist() == [eos, 0]


def test_warming_builds_the_tables_once_and_compiles_use_them(default_model):
    """``warm`` (a served executor's start-up) builds the tokenizer's tables; a later
    compile reuses them and the cache returns the same compiled grammar."""
    from executor.engine.structured_output import GrammarCompiler

    grammars = GrammarCompiler(lambda: default_model.path, 49152, frozenset({2}))
    grammars.warm()
    tables = grammars._compiler
    assert tables is not None
    grammars.warm()
    compiled = grammars.compile(SPECS["choice"])
    assert grammars._compiler is tables and grammars.compile(SPECS["choice"]) is compiled


@pytest.mark.model
def test_a_tensor_parallel_group_gives_the_single_rank_constrained_answers(small_model, tokenizer):
    """S over 2 ranks (gloo): the bitmasks travel in the pickled step to the rank that
    samples; constrained answers (with preemption and chunked prefill at work, as the
    parallel tests' configuration makes them) equal the single-rank engine's."""
    from tests.support.parallel import parallel_config

    prompts = [chat(tokenizer, QUESTIONS[k]) for k in SPECS]
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_output=s) for s in SPECS.values()]
    single = LLMEngine(parallel_config(str(small_model), num_blocks=24))
    try:
        expected = single.generate(prompts, params)
    finally:
        single.shutdown()
    group = LLMEngine(parallel_config(str(small_model), tensor_parallel_size=2, num_blocks=24))
    try:
        assert group.generate(prompts, params) == expected
        assert group.kv_cache_manager.num_free_blocks == 24
    finally:
        group.shutdown()
    answers = dict(zip(SPECS, (tokenizer.decode(o, skip_special_tokens=True) for o in expected)))
    assert answers["choice"] in SPECS["choice"].choices  # random weights, yet only a choice can come out
    assert answers["grammar"] in ("The answer is red.", "The answer is blue.")


def finished_outputs(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Runs the requests to their end: id → (tokens, finish reason, logprob of each token)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    got = {request_id: ([], None, []) for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _, logprobs = got[out.request_id]
            tokens += out.new_token_ids
            logprobs += [e.logprob for e in out.logprobs or ()]
            got[out.request_id] = (tokens, out.finish_reason, logprobs)
    return got


def test_a_grammar_at_a_dead_end_ends_the_request_without_a_token_it_forbids(engine, tokenizer):
    """After "Hello" this grammar allows no token (its rule ``tail`` has no sentence): the
    request ends "stop" with the text it accepted, greedy or sampled, and no token the
    grammar forbids (it was token 0, sampled from a row all -inf, with a NaN logprob)."""
    spec = StructuredOutput("grammar", 'root ::= "Hello" tail\ntail ::= tail')
    prompt = chat(tokenizer, "Say hello.")
    got = finished_outputs(engine, {
        "dead-end-greedy": (prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, structured_output=spec)),
        "dead-end-sampled": (prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=2,
                                                    structured_output=spec)),
    })
    for tokens, finish_reason, logprobs in got.values():
        assert (tokenizer.decode(tokens), finish_reason) == ("Hello", "stop")
        assert len(logprobs) == len(tokens) and all(-100.0 < lp <= 0.0 for lp in logprobs)
    assert got["dead-end-greedy"][0] == [19556]
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("spec", [
    StructuredOutput("grammar", "root ::= root"),
    StructuredOutput("grammar", "root ::= [^\\x00-\\U0010ffff]"),
    StructuredOutput("json", json_spec({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
])
def test_a_grammar_with_no_sentence_the_tokenizer_can_form_is_refused(engine, spec):
    """No first token fits: refused before anything is queued (it sampled token 0 with a
    NaN logprob and ended "stop")."""
    with pytest.raises(InvalidArgument) as raised:
        engine.add_request("no-sentence", [1, 2, 3], SamplingParams(structured_output=spec))
    assert str(raised.value) == (f"structured output {spec.kind}: no text the model's tokenizer can form "
                                 "starts a sentence of it (its grammar allows no first token)")
    assert not engine.has_unfinished_requests()


def test_a_request_whose_mask_takes_too_long_to_fill_ends_abort_and_frees_its_blocks(engine, tokenizer,
                                                                                    monkeypatch):
    """A fill over ``MAX_MASK_FILL_S`` (set below any fill here) marks the request: the
    token its mask chose is kept and it ends "abort" there, beside a plain request that
    runs to its end."""
    from executor.engine import structured_output

    monkeypatch.setattr(structured_output, "MAX_MASK_FILL_S", -1.0)
    prompt = chat(tokenizer, QUESTIONS["json"])
    got = finished_outputs(engine, {
        "slow": (prompt, SamplingParams(max_tokens=8, temperature=0.0, structured_output=SPECS["json"])),
        "plain": (prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    })
    tokens, reason, _ = got["slow"]
    assert (tokens, reason) == ([107], "abort")  # '{', the grammar's first token, then the end
    assert got["plain"][1] == "length" and len(got["plain"][0]) == 8
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
