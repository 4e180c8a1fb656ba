"""LLMEngine on the default model: validation, continuous batching, abort, stops."""

from __future__ import annotations

import pytest

from executor.engine.config import CacheConfig, EngineConfig
from meshserve.errors import InvalidArgument
from meshserve.sampling import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_public_attributes(engine, default_model):
    assert engine.model_id == default_model.model_id and engine.revision == default_model.revision
    assert (engine.max_model_len, engine.vocab_size, engine.block_size, engine.num_blocks) == (8192, 49152, 16, 256)
    assert engine.eos_token_ids == frozenset({2})
    stats = engine.stats()
    assert (stats.num_blocks, stats.block_size, stats.max_model_len) == (256, 16, 8192)


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt_token_ids must not be empty"),
    ([1, 49152], GREEDY, "outside the vocabulary"),
    ([-1], GREEDY, "outside the vocabulary"),
    ([1] * 8192, GREEDY, "max_model_len 8192"),
    ([1] * 5000, GREEDY, "the whole KV cache has 256 blocks"),
    ([1], SamplingParams(top_p=0.0), "top_p"),
    ([1], SamplingParams(max_tokens=0), "max_tokens"),
])
def test_add_request_rejects(engine, prompt, params, message):
    with pytest.raises(InvalidArgument, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()


def test_check_request_checks_params_then_prompt_once_and_add_checked_takes_it(engine):
    """``check_request`` is the one check (params first, as the executor's servicer always
    reported them); its ``CheckedRequest`` is queued by ``add_checked`` as it is, which
    checks only the request id."""
    with pytest.raises(InvalidArgument, match="top_p"):
        engine.check_request([], SamplingParams(top_p=0.0))
    checked = engine.check_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, top_k=-1, n=2))
    assert checked.prompt_token_ids == (1, 2, 3) and checked.sampling_params.top_k == 0
    assert checked.for_choice(1).sampling_params == checked.sampling_params.for_choice(1)
    engine.add_checked("checked", checked)
    with pytest.raises(InvalidArgument, match="request_id 'checked' is already in use"):
        engine.add_checked("checked", checked)
    with pytest.raises(InvalidArgument, match="request_id must not be empty"):
        engine.add_checked("", checked)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == engine.generate([[1, 2, 3]], checked.sampling_params)[0]
    assert outs[-1].finish_reason == "length"


def test_duplicate_request_id_and_abort(engine):
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidArgument, match="request_id 'dup' is already in use"):
        engine.add_request("dup", [4, 5], GREEDY)
    engine.step()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
    aborted = engine.stats().num_aborted
    assert engine.abort_request("dup") and not engine.abort_request("dup")
    stats = engine.stats()
    assert stats.num_free_blocks == engine.num_blocks and stats.num_aborted == aborted + 1
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_short_request_joins_running_batch_and_finishes_first(engine, tokenizer):
    long_prompt = tokenizer("Tell me a long story about a dragon.").input_ids
    short_prompt = tokenizer("Hi").input_ids
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    joined = engine.stats().num_joined_running_batch
    engine.add_request("short", short_prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finished, counts = [], {"long": 3, "short": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] += len(out.new_token_ids)
            if out.finished:
                finished.append((out.request_id, out.finish_reason))
    assert finished == [("short", "length"), ("long", "length")]
    assert counts == {"long": 24, "short": 3}
    assert engine.stats().num_joined_running_batch == joined + 1
    engine.check_integrity()


def test_stop_token_ids_and_eos(engine, tokenizer):
    prompt = tokenizer("Count: one, two, three,").input_ids
    [free_run] = engine.generate([prompt], GREEDY)
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
    engine.add_request("stop", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == free_run[: first + 1]  # the stop token is returned
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    # EOS: the chat model ends its answer with <|im_end|> (id 2) when not told to ignore it.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say OK."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(chat, add_special_tokens=False).input_ids
    [with_eos] = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))
    assert with_eos[-1] == 2 and len(with_eos) < 32
    [ignored] = engine.generate([ids], SamplingParams(max_tokens=len(with_eos) + 3, temperature=0.0, ignore_eos=True))
    assert ignored[: len(with_eos)] == with_eos and len(ignored) == len(with_eos) + 3


def test_sampled_generation_is_reproducible_with_seed(engine, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    a, b = engine.generate([prompt, prompt], [params, params])
    [c] = engine.generate([prompt], params)
    assert a == b == c
    assert all(0 <= t < engine.vocab_size for t in a)


def test_kv_cache_budget_max_model_len_and_chunked_prefill_off():
    from executor.engine.config import BatchSchedulerConfig
    from executor.engine.kv_cache_manager import num_blocks_for_budget
    from executor.engine.llm_engine import LLMEngine

    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 kv heads, head_dim 64, float32
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=4 * block_bytes + 5),
                                 max_model_len=512,
                                 batch=BatchSchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=False)))
    assert eng.num_blocks == 4 and eng.max_model_len == 512
    with pytest.raises(InvalidArgument, match="max_model_len 512"):
        eng.add_request("x", [1] * 512, GREEDY)
    with pytest.raises(InvalidArgument, match="more than max_num_batched_tokens 32"):
        eng.add_request("x", [1] * 33, GREEDY)
    # 64 tokens of cache: a request is clamped there ("length"), never deadlocked
    [out] = eng.generate([[1] * 32], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    assert len(out) == 4 * 16 - 32
    with pytest.raises(ValueError, match="less than one block"):
        num_blocks_for_budget(block_bytes - 1, block_bytes)
