"""A gateway alone (its scheduler unreachable) on the default model's tokenizer, with
its HTTP face on a free port: for the HTTP adapter's tests that need no executor."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx2 as httpx
import pytest

from gateway.server import start_gateway
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from tests.support.redis_server import free_port


@asynccontextmanager
async def served_gateway(**start_kwargs):
    """Yields ``(client, svc)``: an ``httpx.AsyncClient`` on the gateway's HTTP address
    and the started gateway (``start_gateway`` with a memory task store unless
    ``start_kwargs`` names its ``tasks`` runner, plus ``start_kwargs``); stops it after.
    Skips the test when the model package is missing."""
    from meshserve.cli.processes import model_info

    try:
        tokenizer, info = await asyncio.to_thread(model_info, "default")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    start_kwargs.setdefault("tasks", TaskRunner(MemoryTaskStore()))
    svc = await start_gateway(tokenizer, info, f"127.0.0.1:{free_port()}", 0, http_port=0, **start_kwargs)
    try:
        async with httpx.AsyncClient(base_url=f"http://{svc.http.address}", timeout=30) as client:
            yield client, svc
    finally:
        await svc.stop(0.5)
        await svc.servicer.close()
