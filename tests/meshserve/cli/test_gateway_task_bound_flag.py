"""``meshserve gateway --max-unfinished-tasks-per-tenant``: it reaches the gateway's
start (``processes.run_gateway``), 1000 when not given. Nothing is started: the
service is replaced by a recorder. (Its bound at work: tests/gateway/test_tenant_task_bound.py.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gateway.task_runner import DEFAULT_MAX_UNFINISHED_PER_TENANT
from meshserve.cli import app, processes, services

runner = CliRunner()


@pytest.mark.parametrize("args,want", [([], DEFAULT_MAX_UNFINISHED_PER_TENANT),
                                       (["--max-unfinished-tasks-per-tenant", "7"], 7)])
def test_the_per_tenant_task_bound_reaches_the_gateways_start(monkeypatch, args, want):
    starts = []
    monkeypatch.setattr(processes, "run_gateway", lambda *a, **kwargs: starts.append(kwargs))
    monkeypatch.setattr(services, "serve", lambda coro: None)
    result = runner.invoke(app, ["gateway", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0", *args])
    assert result.exit_code == 0, result.output
    assert [s["max_unfinished_tasks_per_tenant"] for s in starts] == [want]
    assert DEFAULT_MAX_UNFINISHED_PER_TENANT == 1000
