"""What ``meshserve up``'s stop signals do, and that its stop line says exactly that:
the first of SIGTERM, SIGHUP or Ctrl-C asks for the stop; while it runs another
SIGTERM or SIGHUP changes nothing and a Ctrl-C kills every service (the
``KeyboardInterrupt`` that ``stop_in_order`` acts on); a SIGINT the process ignores
stays ignored and is never offered."""

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.stop_signals import StopSignals, start_unless_stopped


@pytest.fixture
def sigint_taken():
    """Python's own SIGINT handler, as in a terminal (a test run may inherit SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGHUP])
def test_after_a_sigterm_or_sighup_another_changes_nothing_and_ctrl_c_kills(first, sigint_taken):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    with StopSignals() as signals:
        signal.raise_signal(first)
        assert signals.event.is_set() and signals.received == first.name
        signal.raise_signal(first)  # nothing: no exception, the stop goes on as it was
        assert signals.received == first.name
        assert signals.with_hurry_hint("stopping: …") == (
            f"stopping: …; another {first.name} changes nothing; Ctrl-C (SIGINT) kills every service")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert {sig: signal.getsignal(sig) for sig in previous} == previous  # the handlers are put back


def test_after_a_ctrl_c_another_kills(sigint_taken):
    with StopSignals() as signals:
        signal.raise_signal(signal.SIGINT)  # the first asks for the stop, raises nothing
        assert (signals.received, signals.how()) == ("SIGINT", "Ctrl-C")
        assert signals.with_hurry_hint("stopping: …") == "stopping: …; Ctrl-C again kills every service"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_stop_without_a_signal_offers_ctrl_c(sigint_taken):
    """A service exited: ``up`` sets the event itself; a Ctrl-C then kills every service."""
    with StopSignals() as signals:
        signals.event.set()
        assert signals.with_hurry_hint("stopping: …") == "stopping: …; Ctrl-C (SIGINT) kills every service"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_an_ignored_sigint_stays_ignored_and_is_not_offered():
    """``up`` run as a script's background job: SIGINT ignored, only SIGTERM stops it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert not signals.event.is_set()
            signal.raise_signal(signal.SIGTERM)
            assert signals.with_hurry_hint("stopping: …") == "stopping: …; another SIGTERM changes nothing"
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_once_a_stop_is_asked_calls_kill_before_raising(sigint_taken):
    """The handler kills every service itself: the ``KeyboardInterrupt`` may land anywhere
    (an event loop's own code, a wait that is not ``stop_in_order``'s)."""
    kills = []
    with StopSignals(kill=lambda: kills.append("kill")) as signals:
        signal.raise_signal(signal.SIGTERM)
        assert kills == [] and not signals.killed
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert kills == ["kill"] and signals.killed


IGNORES_SIGTERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").close()
time.sleep(120)
"""


def test_a_ctrl_c_right_after_a_signal_during_start_up_kills_every_service_at_once(sigint_taken, tmp_path):
    """A SIGTERM, then a Ctrl-C before the start-up saw the SIGTERM (it looks every
    ``POLL_S``): the Ctrl-C's ``KeyboardInterrupt`` lands in the event loop, outside the
    start, whose cancellation then stopped the services in order, waiting their bounds
    (40 s for an executor that does not stop), although the Ctrl-C had asked for them to
    be killed, and ``up`` then said they had been. Now they are killed at once."""
    mesh = Mesh(MeshConfig(port=1))
    ready = tmp_path / "ready"

    async def start():
        try:
            mesh.procs.append(("executor-0", subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM, str(ready)])))
            while not ready.exists():
                await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            loop.call_soon(signal.raise_signal, signal.SIGTERM)
            loop.call_soon(signal.raise_signal, signal.SIGINT)  # raised in the loop, not in this task
            await asyncio.sleep(120)
        except BaseException:
            mesh.stop()
            raise

    mesh.start = start
    proc = None
    try:
        with StopSignals(kill=mesh.kill) as signals, pytest.raises(KeyboardInterrupt):
            began = None
            task = start_unless_stopped(mesh, signals, lambda _line: None)

            async def main():
                nonlocal proc, began
                runner = asyncio.ensure_future(task)
                while not mesh.procs:
                    await asyncio.sleep(0.01)
                proc, began = mesh.procs[0][1], time.monotonic()
                await runner

            asyncio.run(main())
        assert proc.returncode == -signal.SIGKILL and time.monotonic() - began < 10
        assert signals.killed
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()



def test_start_up_interrupted_names_the_services_in_the_order_they_stop(sigint_taken):
    """The services stop executors first, then the scheduler and the kvstore
    (``stop_order``); the line used to list them in the order they had started."""
    mesh = Mesh(MeshConfig(port=1))
    lines: list[str] = []

    async def start():
        mesh.procs.extend((name, None) for name in ("kvstore", "scheduler", "executor-0"))
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(120)

    mesh.start = start
    with StopSignals() as signals:
        assert asyncio.run(start_unless_stopped(mesh, signals, lines.append)) is False
    assert lines == ["start-up interrupted (SIGTERM): stopping executor-0, scheduler, kvstore, in order; "
                     "another SIGTERM changes nothing; Ctrl-C (SIGINT) kills every service"]
