"""Loading the executor's C kernels in a test as a new process would."""

from __future__ import annotations

import pytest


def load_fresh(module, cache, monkeypatch, why_not: str, loader: str = "load"):
    """``module.<loader>()`` (a C kernel module's loader: ``cpu_fused.load``,
    ``cpu_gemm.load_bf16``) as a new process would run it, building into ``cache``; skips
    the test with ``why_not`` where it returns None."""
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(cache))
    monkeypatch.setattr(module, "_loaded", {})
    loaded = getattr(module, loader)()
    if loaded is None:
        pytest.skip(why_not)
    return loaded


def run_fresh_process(script: str, cache) -> str:
    """Runs the Python ``script`` in a new interpreter (this checkout as its working
    directory) whose kernels build into ``cache``; returns its standard output.

    Raises:
        AssertionError: the process exited with an error (its stderr's end in the message).
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "MESHSERVE_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.getcwd())
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def small_ints(*shape: int, seed: int, dtype=None):
    """Integers in [-8, 8] (exact in float32 and in bfloat16) as ``dtype`` (default
    float32): their products and float32 sums over a few thousand terms stay below 2**24,
    so a GEMM on them sums exactly, and its result is the integer product (rounded once to
    bfloat16 where the output is bfloat16)."""
    import torch

    values = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed))
    return values.to(dtype or torch.float32)


def paged_batch(query_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """One attention step over a paged cache of random values: ``(q, k, v, (key_cache,
    value_cache), metadata)``, request ``i`` with ``query_lens[i]`` new tokens after
    ``contexts[i]`` cached ones, its blocks scattered over the cache (three spare)."""
    import torch

    from executor.attention import build_attention_metadata

    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // block_size) for c, q in zip(contexts, query_lens)]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()  # scattered blocks
    block_ids, i = [], 0
    for n in need:
        block_ids.append(perm[i:i + n])
        i += n
    shape = (len(perm), block_size, num_kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
    md = build_attention_metadata(query_lens, contexts, block_ids, block_size)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, cache, md
