"""Session-wide test set-up: in-memory trace export and the shared default model."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from meshserve.telemetry import setup_tracing  # noqa: E402

# Every service started in this process exports its spans here (tests/mesh/test_tracing.py).
setup_tracing("tests", "memory")


@pytest.fixture(scope="session")
def default_model_files():
    """The default model's cached safetensors folder (converted from GGUF once)."""
    from meshserve.model_files import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(default_model_files):
    """The default model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_files.path)

