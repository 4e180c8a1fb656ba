"""The order in which ``meshserve up`` stops its services, and the stop itself.

The gateway goes first: it refuses new calls and lets those in flight finish
within its ``--drain-grace-s``, which needs every other service still up. Then
the executors, which drain at once since nothing runs there any more; then the
scheduler and the kvstore, which every step and every Release needed until then.
This is the order Kubernetes gives a rollout of the gateway alone, and the one
that loses nothing when the whole mesh stops (``docs/deploy.md``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0  # the gateway's and the executors' --drain-grace-s default
STOP_MARGIN_S = 10.0  # what a service gets beyond its drain (or one with none) before SIGKILL

SUPPORT_SERVICES = ("scheduler", "kvstore")

PARENT_ENV = "MESHSERVE_STOP_WITH_PARENT"  # set by the launcher: the pid of ``up`` (or of the test or bench)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent() -> None:
    """In a service ``meshserve up`` started (``PARENT_ENV`` set to its pid): asks Linux
    to send this process SIGTERM when ``up`` dies without stopping it (SIGKILL, a
    crash), so that no service outlives it holding its ports; the service then stops
    as on any SIGTERM. If ``up`` is already gone, SIGTERM is sent at once. Elsewhere,
    or off Linux, it does nothing. Linux follows the thread that started the process,
    not the whole launcher: ``Mesh`` starts services from its main thread only."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def stop_order(names: list[str], gateway_grace_s: float, executor_grace_s: float) -> list[tuple[list[str], float]]:
    """The tiers of services ``names`` (``gateway``, ``scheduler``, ``kvstore``, the
    rest executors), first to last, each with its bound in seconds: a drain grace
    plus ``STOP_MARGIN_S``."""
    executors = [n for n in names if n not in ("gateway", *SUPPORT_SERVICES)]
    tiers = [(["gateway"], gateway_grace_s + STOP_MARGIN_S), (executors, executor_grace_s + STOP_MARGIN_S),
             (list(SUPPORT_SERVICES), STOP_MARGIN_S)]
    return [([n for n in tier if n in names], bound) for tier, bound in tiers]


def stop_in_order(procs: dict[str, subprocess.Popen], order: list[tuple[list[str], float]]) -> list[str]:
    """SIGTERM to each tier of ``order`` in turn, SIGKILL to what of it still runs
    after the tier's bound (seconds), then the next tier.

    Returns:
        The services that had to be killed (each also logged as a warning).

    Raises:
        KeyboardInterrupt: a second Ctrl-C while it waited; every process of
            ``procs`` was killed first, in ``order`` (the gateway first).
    """
    killed: list[str] = []
    try:
        for tier, bound in order:
            running = [(n, procs[n]) for n in tier if procs[n].poll() is None]
            for _, proc in running:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + bound
            for name, proc in running:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %g s of its SIGTERM: killed", name, bound)
                    killed.append(name)
                    proc.kill()
                    proc.wait()
    except KeyboardInterrupt:
        for tier, _ in order:
            for name in tier:
                if procs[name].poll() is None:
                    procs[name].kill()
                    procs[name].wait()
        raise
    return killed
