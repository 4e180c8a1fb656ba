"""Session-wide test set-up: in-memory trace export, the shared default model, xdist
groups, and memory back after tests that built engines."""

import gc
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`make test` runs two workers) each worker, and every process it
# starts, runs torch on one thread: two workers with a thread per core each would
# oversubscribe the cores.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if XDIST_WORKER:
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when it is imported, and the attention registry imports
    # it with the first executor module: without CUDA its kernels must run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshserve.telemetry import setup_tracing  # noqa: E402

# Every service started in this process exports its spans here (tests/mesh/test_tracing.py).
setup_tracing("tests", "memory")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with one change: the ``PROCESS_FILES``
    (``tests/support/workers.py``) are one unit of work. Each other file runs whole on
    one worker (its module and session fixtures built there once); units go out
    largest first. (``--dist loadgroup`` cannot express this here: with pytest 9.2,
    xdist 3.8's group suffix no longer changes a node id, so its groups fall apart.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.support.workers import PROCESS_FILES

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "processes" if path in PROCESS_FILES else path

    return FileScheduling(config, log)


_engines = {"count": 0, "test": []}  # engines built in this process; those built in the running test


@pytest.fixture(scope="session", autouse=True)
def track_engines_built():
    """Wraps ``LLMEngine.__init__`` once: counts every engine built and lists those
    built in the running test (``engines_built_in_test``)."""
    from executor.engine.llm_engine import LLMEngine

    original = LLMEngine.__init__

    def tracking(self, *args, **kwargs):
        _engines["count"] += 1
        original(self, *args, **kwargs)
        _engines["test"].append(self)

    LLMEngine.__init__ = tracking
    yield
    LLMEngine.__init__ = original


@pytest.fixture(scope="module", autouse=True)
def collect_module_engines(track_engines_built):
    """A full garbage collection after a module that built engines (its fixtures' included)."""
    before = _engines["count"]
    yield
    if _engines["count"] != before:
        gc.collect()


@pytest.fixture(autouse=True)
def engines_built_in_test(track_engines_built):
    """The engines built during this test (its function fixtures included), for checks at
    its end (``tests/executor/conftest.py``); then a full garbage collection if there
    were any. An engine a test drops may still sit in reference cycles (one served in a
    test mesh, reached from the services' objects), and then stays in memory, model and
    KV cache (~1-2 GB), until Python's cyclic collector happens to run: without this,
    the worker running the mesh tests grew to 9 GB."""
    before = _engines["count"]
    made = _engines["test"] = []
    yield made
    _engines["test"] = []
    made.clear()
    if _engines["count"] != before:
        gc.collect()


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

