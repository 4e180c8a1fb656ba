"""Prefix caching on the default model: reported cached tokens, computed tokens, and
outputs identical warm and cold (case C08), plus priority preemption (case C22)."""

from __future__ import annotations

import pytest

from executor.attention import cpu_kernel, cpu_prefill_kernel
from executor.attention.torch_backend import TorchAttentionBackend
from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.sampling import SamplingParams

pytestmark = pytest.mark.model


def make_engine(budget: int, num_blocks: int = 64, max_num_seqs: int = 8, caching: bool = True) -> LLMEngine:
    """A float32 engine (named: ``auto`` is bfloat16 on CPUs with native bf16)."""
    return LLMEngine(EngineConfig(dtype="float32",
                                  cache=CacheConfig(block_size=16, num_blocks=num_blocks,
                                                    enable_prefix_caching=caching),
                                  batch=BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)))


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int, int]:
    """Runs one request alone; returns (tokens, reported cached tokens, prompt tokens computed)."""
    before = engine.stats().num_prompt_tokens
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens if cached is None else cached
    engine.check_integrity()
    return tokens, cached, engine.stats().num_prompt_tokens - before


def prompt_of(tokenizer, n: int, salt: str) -> list[int]:
    text = " ".join(f"{salt} item {i} is a small green stone." for i in range(200))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    assert len(ids) == n
    return ids


def test_chunked_prefill_with_the_prefix_cache_computes_only_uncached_tokens(tokenizer):
    """Case C08: a warm run reports its cached tokens, computes only the rest (in
    chunks of the step budget) and gives the cold run's tokens."""
    engine = make_engine(budget=16)
    p40 = prompt_of(tokenizer, 40, "alpha")
    cold, cached, computed = run_one(engine, "a1", p40, 8)
    assert (cached, computed) == (0, 40)
    warm, cached, computed = run_one(engine, "a2", p40, 8)
    assert cached == 32 and computed == 8 <= 16
    assert warm == cold

    engine = make_engine(budget=64)
    p200 = prompt_of(tokenizer, 200, "beta")
    cold, cached, computed = run_one(engine, "b1", p200, 8)
    assert (cached, computed) == (0, 200)
    warm, cached, computed = run_one(engine, "b2", p200, 8)
    assert (cached, computed) == (192, 8)
    assert warm == cold
    # a block-aligned full-prompt hit still recomputes its last block's tokens (one position to sample)
    p192 = p200[:192]
    _, cached, computed = run_one(engine, "b3", p192, 2)
    assert (cached, computed) == (176, 16)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_cached_free_blocks > 0


def test_prefix_caching_off_never_reuses(tokenizer):
    engine = make_engine(budget=64, caching=False)
    p = prompt_of(tokenizer, 100, "gamma")
    first, cached1, computed1 = run_one(engine, "c1", p, 4)
    second, cached2, computed2 = run_one(engine, "c2", p, 4)
    assert (cached1, computed1, cached2, computed2) == (0, 100, 0, 100) and first == second
    assert engine.stats().prefix_cache_queried_tokens == 200 and engine.stats().prefix_cache_hit_tokens == 0


def test_higher_priority_preempts_the_latest_lower_priority_request(tokenizer):
    """Case C22: max_num_seqs 2: two low-priority streams run; a high-priority request gets its
    first token in the step after it arrives, the latest low one is preempted and later
    finishes with exactly its unpreempted tokens; an equal-priority arrival never preempts."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    lows = [prompt_of(tokenizer, 30, "low-a"), prompt_of(tokenizer, 50, "low-b")]
    ref = make_engine(budget=256, max_num_seqs=4, caching=False).generate(lows, greedy)

    engine = make_engine(budget=256, max_num_seqs=2, caching=False)
    outputs: dict[str, list[int]] = {"l0": [], "l1": [], "eq": [], "hi": []}

    def step() -> list[str]:
        results = engine.step()
        for out in results:
            outputs[out.request_id] += out.new_token_ids
        return [out.request_id for out in results]

    engine.add_request("l0", lows[0], greedy, priority=0)
    engine.add_request("l1", lows[1], greedy, priority=0)
    for _ in range(5):
        step()
    engine.add_request("eq", prompt_of(tokenizer, 20, "eq"), SamplingParams(max_tokens=4, temperature=0.0), priority=0)
    assert sorted(step()) == ["l0", "l1"] and engine.stats().num_preemptions == 0  # equal: waits
    hi_prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"])
    engine.add_request("hi", hi_prompt, SamplingParams(max_tokens=8, temperature=0.0), priority=5)
    assert "hi" in step()  # first token in the very next step
    assert engine.stats().num_preemptions == 1
    assert engine.batch_scheduler.requests["l1"].num_preemptions == 1  # the latest low arrival
    while engine.has_unfinished_requests():
        step()
    assert outputs["l0"] == ref[0] and outputs["l1"] == ref[1]
    assert 1 <= len(outputs["hi"]) <= 8 and len(outputs["eq"]) >= 1
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.num_blocks


def test_bfloat16_prompts_get_the_same_bits_warm_and_cold(tokenizer):
    """Case C08 in bfloat16, the dtype ``auto`` picks on CPUs with native bfloat16, on one
    thread (the CPU kernels' path): a 49-token prompt, prefilled in one chunk cold and warm
    computing only its last token (a step shaped like a decode, which the decode kernel
    runs), and a 100-token one prefilled in chunks of 64 cold and of 4 tokens warm give the
    cold runs' tokens and logprobs bit for bit."""
    if cpu_kernel.load() is None:
        pytest.skip("no CPU decode kernel (no C compiler): bfloat16 attention runs in SDPA")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=1,
                                    cache=CacheConfig(block_size=16, num_blocks=64),
                                    batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))

    def run(request_id: str, prompt: list[int]) -> list[tuple[int, float]]:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              logprobs=0))
        got = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                got += [(entry.token_id, entry.logprob) for entry in out.logprobs]
        return got

    for n, salt in ((49, "delta"), (100, "epsilon")):
        p = prompt_of(tokenizer, n, salt)
        cold = run(f"{salt}-cold", p)
        assert len(cold) == 6
        assert run(f"{salt}-warm", p) == cold
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 48 + 96


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefill_kernel", ["on", "off"])
def test_a_short_prompt_beside_a_long_one_gets_the_bits_it_gets_alone(tokenizer, monkeypatch, dtype, prefill_kernel):
    """A 100-token prompt prefilled cold in one step with a 450-token one (a chunk past
    PREFILL_KERNEL_MAX_LEN, which SDPA runs, or in bfloat16 the prefill kernel where the CPU
    has one) keeps the decode kernel's rows: its warm run alone (96 tokens cached, 4
    computed) gives the same tokens and logprobs bit for bit. ``off`` switches the prefill
    kernel off (``MESHSERVE_CPU_PREFILL_KERNEL=0``), as on an AVX2-only CPU."""
    if cpu_kernel.load() is None:
        pytest.skip("no CPU attention kernel here (it needs a C compiler)")
    if prefill_kernel == "on" and (dtype == "float32" or cpu_prefill_kernel.load() is None):
        pytest.skip("the prefill kernel runs bfloat16 only, on AVX512-BF16")
    if prefill_kernel == "off":
        monkeypatch.setattr(TorchAttentionBackend, "_cpu_prefill_kernel", lambda self: None)
    else:  # taken for long chunks even where SDPA is the faster (a CPU with AMX-BF16)
        monkeypatch.setattr(cpu_prefill_kernel, "preferred", cpu_prefill_kernel.load)
    engine = LLMEngine(EngineConfig(dtype=dtype, num_threads=1,
                                    cache=CacheConfig(block_size=16, num_blocks=64),
                                    batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024)))
    short, long = prompt_of(tokenizer, 100, "zeta"), prompt_of(tokenizer, 450, "eta")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    got: dict[str, list[tuple[int, float]]] = {"cold": [], "long": [], "warm": []}
    engine.add_request("cold", short, params)
    engine.add_request("long", long, params)
    steps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append({out.request_id for out in outs})
        for out in outs:
            got[out.request_id] += [(entry.token_id, entry.logprob) for entry in out.logprobs]
    assert steps[0] == {"cold", "long"}  # one step prefilled both
    engine.add_request("warm", short, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += [(entry.token_id, entry.logprob) for entry in out.logprobs]
    assert len(got["cold"]) == 4 and got["warm"] == got["cold"]
