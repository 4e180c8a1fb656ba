"""The signals that stop ``meshserve up``, from its first service's start to its last one's exit.

``StopSignals`` takes SIGTERM, SIGHUP (the terminal closed) and SIGINT (Ctrl-C)
before any service starts: the first of them asks for the stop (``event``); once a
stop is asked for, a SIGINT kills every service, at once, from the handler itself
(``kill``), then raises ``KeyboardInterrupt``, wherever the program is then (an
event loop between two steps, a wait of the autoscaler), while another SIGTERM or
SIGHUP changes nothing. SIGINT is taken only when Python's own handler has it (a
background job of a script, which ignores SIGINT, keeps ignoring it).

``start_unless_stopped`` starts the mesh and looks for a stop meanwhile: a signal
during start-up cancels the start, and ``Mesh.start`` stops the services it already
started, in order, at once, without waiting for the others to come up. (A service
that gets its SIGTERM while it loads, an executor its model, finishes loading, then
stops: its own stop, as in a container.)
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import Callable

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
POLL_S = 0.1  # how often a start under way looks for a stop (seconds)


class StopSignals:
    """``up``'s handlers of SIGTERM, SIGHUP and SIGINT; a context manager (the previous
    handlers come back at its exit). Installed from the main thread only.

    Attributes:
        event: set by the first signal, or by ``up`` itself when it stops for another
            reason (a service exited); a SIGINT after it calls ``kill`` and raises
            ``KeyboardInterrupt``.
        received: the first signal's name (``"SIGTERM"``, ``"SIGHUP"``, ``"SIGINT"``),
            or None.
        takes_sigint: whether SIGINT is handled here (False: it is ignored, as in a
            script's background job).
        killed: whether a SIGINT after ``event`` called ``kill``.

    Args:
        kill: SIGKILL to every service (``Mesh.kill``), called by that SIGINT; None:
            nothing is called.
    """

    def __init__(self, kill: Callable[[], None] | None = None):
        self.event = threading.Event()
        self.received: str | None = None
        self.takes_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        self.killed = False
        self._kill = kill
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGHUP, *([signal.SIGINT] if self.takes_sigint else [])):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT and self.event.is_set():  # Ctrl-C again: every service killed
            if self._kill is not None:  # here: a KeyboardInterrupt outside stop_in_order would kill nothing
                self._kill()
                self.killed = True
            raise KeyboardInterrupt
        if self.received is None:
            self.received = NAMES[signum]
        self.event.set()

    def how(self) -> str:
        """The first signal as ``up`` names it (``"SIGTERM"``; ``"Ctrl-C"`` for SIGINT)."""
        return "Ctrl-C" if self.received == "SIGINT" else self.received or "no signal"

    def hurry_hint(self) -> str:
        """What a further signal does while the services stop, exactly as the handlers
        act: ``"another SIGTERM changes nothing; Ctrl-C (SIGINT) kills every service"``
        (SIGTERM, SIGHUP), ``"Ctrl-C again kills every service"`` (SIGINT); without a
        signal (a service exited) the Ctrl-C part alone; the SIGTERM/SIGHUP part alone
        when SIGINT is ignored."""
        parts = []
        if self.received in ("SIGTERM", "SIGHUP"):
            parts.append(f"another {self.received} changes nothing")
        if self.takes_sigint:
            parts.append("Ctrl-C again kills every service" if self.received == "SIGINT"
                         else "Ctrl-C (SIGINT) kills every service")
        return "; ".join(parts)

    def with_hurry_hint(self, line: str) -> str:
        """``line``, then ``hurry_hint()`` after ``"; "`` (when there is one)."""
        return "; ".join(part for part in (line, self.hurry_hint()) if part)


async def start_unless_stopped(mesh, signals: StopSignals, say: Callable[[str], None]) -> bool:
    """Runs ``mesh.start()`` (a ``meshserve.cli.launcher.Mesh``) until every service is
    up (True), or until ``signals.event`` is set: then says so (``say``: one line
    naming the signal, the services started so far in the order they will stop, and
    ``hurry_hint``), cancels the
    start, which stops those services in order (``Mesh.start``), and returns False once
    they are stopped (``Mesh.killed``: those that had to be killed). A signal just as
    the last service came up counts as one after the start (True).

    Raises:
        Exception: what ``mesh.start()`` raised (it stopped what it started).
        KeyboardInterrupt: Ctrl-C again while the services stopped (every one killed).
    """
    start = asyncio.ensure_future(mesh.start())
    while not signals.event.is_set() and not start.done():
        await asyncio.wait({start}, timeout=POLL_S)
    if start.done():
        start.result()
        return True
    started = ", ".join(name for tier, _ in mesh.stop_order() for name in tier)  # as they will stop
    say(signals.with_hurry_hint(f"start-up interrupted ({signals.how()}): "
                                + (f"stopping {started}, in order" if started else "no service had started")))
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    return False
