"""Loading the executor's C kernels in a test as a new process would."""

from __future__ import annotations

import pytest


def load_fresh(module, cache, monkeypatch, why_not: str):
    """``module.load()`` (a C kernel module: ``cpu_fused``, ``cpu_gemm``) as a new process
    would run it, building into ``cache``; skips the test with ``why_not`` where it
    returns None."""
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(cache))
    monkeypatch.setattr(module, "_loaded", {})
    loaded = module.load()
    if loaded is None:
        pytest.skip(why_not)
    return loaded
