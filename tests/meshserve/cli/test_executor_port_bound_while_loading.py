"""``meshserve executor`` binds its gRPC, health and metrics ports before the model loads, so a
port chosen for it (``meshserve up`` picks a free one) is not taken by another process
during the load; calls wait until it serves."""

from __future__ import annotations

import socket

import httpx2 as httpx
import pytest

import executor.engine.llm_engine as llm_engine
from meshserve.cli import processes
from meshserve.cli.ports import free_port, port_is_free


async def test_the_executor_holds_its_ports_while_its_model_loads(monkeypatch):
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    seen = {}

    def loading(_config):
        seen.update(port=port_is_free(port), health_port=port_is_free(health_port),
                    metrics_port=port_is_free(metrics_port),
                    metrics=httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text)
        raise RuntimeError("the model failed to load")

    monkeypatch.setattr(llm_engine, "LLMEngine", loading)
    with pytest.raises(RuntimeError, match="the model failed to load"):
        await processes.run_executor(None, port, "127.0.0.1", "127.0.0.1:1", "executor-x", health_port=health_port,
                                     metrics_port=metrics_port)
    metrics = seen.pop("metrics")
    assert seen == {"port": False, "health_port": False, "metrics_port": False}
    assert 'meshserve_build_info{service="executor"' in metrics  # served while loading, the engine's not yet
    assert "meshserve_engine" not in metrics
    assert [port_is_free(p) for p in (port, health_port, metrics_port)] == [True, True, True]  # freed on the failure


async def test_a_busy_port_fails_the_start_and_leaves_the_others_free():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port, metrics_port = free_port(), free_port()
        with pytest.raises(OSError, match="cannot listen on"):
            await processes.run_executor(None, busy.getsockname()[1], "127.0.0.1", "127.0.0.1:1", "executor-x",
                                         metrics_port=metrics_port)
        assert port_is_free(metrics_port)  # the metrics port, bound first, was let go
        with pytest.raises(OSError, match="metrics: cannot listen on"):
            await processes.run_executor(None, port, "127.0.0.1", "127.0.0.1:1", "executor-x",
                                         metrics_port=busy.getsockname()[1])
        assert port_is_free(port)  # the gRPC port was never bound
    finally:
        busy.close()
