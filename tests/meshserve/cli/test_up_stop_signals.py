"""What ``meshserve up``'s stop signals do, and that its stop line says exactly that:
the first of SIGTERM, SIGHUP or Ctrl-C asks for the stop; while it runs another
SIGTERM or SIGHUP changes nothing and a Ctrl-C kills every service (the
``KeyboardInterrupt`` that ``stop_in_order`` acts on); a SIGINT the process ignores
stays ignored and is never offered."""

import signal

import pytest

from meshserve.cli.stop_signals import StopSignals


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
