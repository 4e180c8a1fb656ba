"""``meshserve executor`` refuses a tensor-parallel size the default model cannot be
split into, from its config.json and before anything loads (case C32 (a))."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

import pytest

from scheduler.server import start_scheduler


@pytest.mark.parametrize("size", [2, 4])
async def test_executor_refuses_a_size_that_does_not_split_the_heads(size, default_model_files):
    """Case C32 (a): the default model at TP=2 and TP=4: the executor exits with a usage
    error (code 2) within 10 s, naming 9 attention heads, 3 KV heads and the valid sizes
    (1 and 3); the scheduler it was pointed at never sees a registration."""
    svc = await start_scheduler(0)
    registry = svc.servicer.core.registry
    registered = []
    add = registry.add
    registry.add = lambda state: (registered.append(state), add(state))[1]
    try:
        env = {**os.environ, "COLUMNS": "400"}
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshserve.cli", "executor", "--scheduler", svc.address, "--port", "0",
            "--insecure", "--tensor-parallel-size", str(size), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        elapsed = time.monotonic() - started
        message = " ".join(re.sub(r"[│╭╮╰╯─]", " ", err.decode()).split())
        assert proc.returncode == 2, message
        assert (f"tensor-parallel size {size} does not split this model (9 attention heads, 3 KV heads, "
                "intermediate_size 1536)") in message
        assert message.endswith("divide or be a multiple of the KV heads: one of 1, 3")
        assert elapsed < 10, f"refused after {elapsed:.1f} s"
        assert registered == [] and list(registry) == []
    finally:
        await svc.stop(0)
