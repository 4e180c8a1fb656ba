"""Session-wide test set-up: in-memory trace export and the shared default model."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when it is imported, and the attention registry imports
    # it with the first executor module: without CUDA its kernels must run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshserve.telemetry import setup_tracing  # noqa: E402

# Every service started in this process exports its spans here (tests/mesh/test_tracing.py).
setup_tracing("tests", "memory")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Puts torch's thread count back after each test: an engine built with
    ``num_threads`` (``torch.set_num_threads``) changes it for the whole process,
    and every later test would run on that many cores."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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

