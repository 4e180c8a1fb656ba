"""Fixtures shared by the executor tests: the default model's files and tokenizer,
one general-purpose engine, the golden prompts and their transformers reference
(all made once per session)."""

from __future__ import annotations

import pytest

from tests.support.reference import GOLDEN_MAX_TOKENS

@pytest.fixture(scope="session")
def default_model(default_model_files):
    """The default model's files (``tests/conftest.py`` resolves them; the tokenizer
    fixture comes from there too)."""
    return default_model_files


@pytest.fixture(scope="session")
def engine():
    """A default-model engine for behaviour tests (idle between tests)."""
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256),
                                 batch=BatchSchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)))
    yield eng
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="session")
def golden_prompts(tokenizer):
    from tests.support.reference import golden_prompts

    return golden_prompts(tokenizer)


@pytest.fixture(scope="session")
def golden_reference(default_model, golden_prompts):
    """transformers' greedy outputs for the golden prompts (cached on disk by content)."""
    from tests.support.reference import HFReference, cached_reference

    key = {"model": default_model.model_id, "revision": default_model.revision, "prompts": golden_prompts,
           "max_new_tokens": GOLDEN_MAX_TOKENS, "ignore_eos": True}
    return cached_reference(key, lambda: HFReference(default_model.path).greedy_many(golden_prompts,
                                                                                      GOLDEN_MAX_TOKENS))


@pytest.fixture(autouse=True)
def kv_invariants_after_each_test(engines_built_in_test):
    """After every executor test, every engine made during it (and the shared one) must
    hold the KV invariants: free + evictable cached + referenced == num_blocks, and each
    block's reference count == the requests holding it."""
    yield
    for engine in engines_built_in_test:
        engine.check_integrity()


@pytest.fixture(scope="session")
def small_model(tmp_path_factory, default_model_files):
    """S of the behaviour cases (``tests.support.parallel.SMALL``): a safetensors folder
    with fixed-seed random weights and the default model's tokenizer."""
    from tests.support.parallel import save_small

    return save_small(tmp_path_factory.mktemp("small-llama"), default_model_files.path)


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """A cache folder a module's tests share: its C kernels are built once."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the CPU kernels' path; ``tests/conftest.py``
    puts the count back after it)."""
    import torch

    torch.set_num_threads(1)
