"""``meshserve up`` says which service it still waits for, every ``WAIT_NOTE_S`` of its
start, with the service's log when there is one: a first start on a busy host builds
kernels and converts the model for minutes, and used to print nothing meanwhile."""

import asyncio

from meshserve.cli import launcher
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig


class Running:
    """A service process that has not exited."""

    def poll(self):
        return None


def test_a_slow_start_is_reported_every_wait_note(tmp_path, monkeypatch):
    now = {"t": 0.0}

    def clock() -> float:  # each read advances 5 s: the loop reads it once a poll
        t = now["t"]
        now["t"] += 5.0
        return t

    async def serving_at_70_s(address, timeout, service="", tls=None):
        while now["t"] < 70.0:
            await asyncio.sleep(0)

    monkeypatch.setattr(launcher, "wait_serving", serving_at_70_s)
    monkeypatch.setattr(launcher, "START_POLL_S", 0.001)
    mesh = Mesh(MeshConfig(port=0, log_dir=tmp_path, cpu_affinity=False))
    mesh.procs = [("gateway", Running())]
    lines: list[str] = []
    mesh.on_progress, mesh.clock = lines.append, clock
    asyncio.run(mesh._wait("gateway", "127.0.0.1:1"))
    assert lines == [f"still waiting for gateway to serve ({t} s; its log: {tmp_path / 'gateway.log'})"
                     for t in (35, 65)]


def test_without_a_listener_or_a_log_dir_nothing_is_said_or_named(monkeypatch):
    async def serving(address, timeout, service="", tls=None):
        return None

    monkeypatch.setattr(launcher, "wait_serving", serving)
    mesh = Mesh(MeshConfig(port=0, cpu_affinity=False))
    mesh.procs = [("scheduler", Running())]
    asyncio.run(mesh._wait("scheduler", "127.0.0.1:1"))  # no on_progress: nothing to call
    times = iter([0.0, 31.0, 31.0, 31.0])
    lines: list[str] = []
    mesh.on_progress, mesh.clock = lines.append, lambda: next(times)

    async def serving_after_a_poll(address, timeout, service="", tls=None):
        await asyncio.sleep(0.05)

    monkeypatch.setattr(launcher, "wait_serving", serving_after_a_poll)
    monkeypatch.setattr(launcher, "START_POLL_S", 0.2)
    asyncio.run(mesh._wait("scheduler", "127.0.0.1:1"))
    assert lines == ["still waiting for scheduler to serve (31 s)"]
