"""``run_mesh``: ``meshserve up`` in the foreground, from the mesh's start to ``up``'s exit code.

Here the mesh (``meshserve.cli.launcher.Mesh``) is started, watched and stopped:
Ctrl-C, SIGTERM or SIGHUP stops every service (one during start-up, those started
so far; ``meshserve.cli.stop_signals``) in ``Mesh.stop_order``, and a Ctrl-C while
it stops kills them all; a service that exits stops the rest. ``up`` then exits
with code 1, as it does when a service had to be killed or the mesh could not
start. With ``MeshConfig.autoscale`` the wait is the local autoscaler's
(``meshserve.cli.autoscale``). What ``up`` says meanwhile (its addresses, metrics
endpoints and cores; what it stops) is written here too.
"""

from __future__ import annotations

import asyncio
import contextlib

import typer


def run_mesh(mesh) -> None:
    """Warns when the executors' threads outnumber the cores (``Mesh.cpu_warning``),
    starts ``mesh``, prints its addresses, its cores (and where its certificates are,
    for clients, under ``--tls-dir``), waits for Ctrl-C, SIGTERM or SIGHUP (with
    ``config.autoscale``, starting and draining executors as the planner says),
    stops it. A signal during start-up stops the services started so far, at once
    (``meshserve.cli.stop_signals``).

    Raises:
        typer.Exit: code 1 when it cannot start, a service exits or had to be killed.
    """
    from meshserve.cli.stop_signals import StopSignals

    with StopSignals(kill=mesh.kill) as signals:
        if _start(mesh, signals):
            _serve_until_stopped(mesh, signals)


def _start(mesh, signals) -> bool:
    """Starts ``mesh`` unless a stop signal comes first (``start_unless_stopped``): True
    once every service is up; False once those started so far are stopped.

    Raises:
        typer.Exit: code 1 when it cannot start, or a service had to be killed.
    """
    from meshserve.cli.stop_signals import start_unless_stopped

    if mesh.cpu_warning:  # said before the start: the executors load the model meanwhile
        typer.echo(f"warning: {mesh.cpu_warning}", err=True)
    mesh.on_progress = lambda line: _say(line, err=True)
    try:  # start() stops whatever it started when it fails or is cancelled
        if asyncio.run(start_unless_stopped(mesh, signals, _say)):
            return True
        killed = mesh.killed
    except KeyboardInterrupt:  # Ctrl-C again once a stop was asked for: its handler killed them
        killed = ["every service"]
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    _say_stopped(killed)
    if killed:
        raise typer.Exit(1)
    return False


def _say(line: str, err: bool = False) -> None:
    """One line on stdout (``err``: stderr), if the terminal is still there (SIGHUP: the
    services are stopped anyway)."""
    with contextlib.suppress(OSError):
        typer.echo(line, err=err)


def _say_stopped(killed: list[str]) -> None:
    """The services that had to be killed, if any (stderr), then ``meshserve stopped.``"""
    if killed:
        with contextlib.suppress(OSError):
            typer.echo(f"killed: {', '.join(killed)} (did not stop in time, or Ctrl-C while stopping)", err=True)
    _say("meshserve stopped.")


def _serve_until_stopped(mesh, signals) -> None:
    """Prints the running mesh, waits for a stop signal (or a service's exit), stops it.

    Raises:
        typer.Exit: code 1 when a service exited or had to be killed.
    """
    scale = mesh.config.autoscale
    failed = False
    try:
        kv = f", kvstore {mesh.kvstore_address}" if mesh.kvstore_address else ""
        tls_dir = mesh.config.tls_dir
        if tls_dir:
            kv += f"; mutual TLS (certificates in {tls_dir}; clients: --tls-ca {tls_dir}/ca.pem)"
        http = f", HTTP http://{mesh.http_address}/v1" if mesh.http_address else ""
        typer.echo(f"meshserve is up: gateway {mesh.gateway_address}{http}, scheduler {mesh.scheduler_address}, "
                   f"executors {', '.join(mesh.executor_addresses)}{kv}. Ctrl-C stops it.")
        for name, address in mesh.metrics_addresses.items():
            typer.echo(f"  metrics {name}: http://{address}/metrics")
        if mesh.cores_line():
            typer.echo(f"  cores: {mesh.cores_line()}")
        if scale is not None:
            from meshserve.cli.autoscale import LocalAutoscaler

            typer.echo(f"autoscaling executors within {scale[0]}..{scale[1]}")
            gone = asyncio.run(LocalAutoscaler(mesh, *scale).run(signals.event))
        else:
            while not signals.event.wait(0.5) and not mesh.exited():
                pass
            gone = mesh.exited()
        if gone:
            typer.echo(f"service(s) exited: {', '.join(gone)}; stopping the mesh", err=True)
            failed = True
    except KeyboardInterrupt:  # Ctrl-C twice before the wait saw the first: its handler killed every service
        pass
    finally:
        signals.event.set()  # a stop is under way (also after a service exited): a Ctrl-C now kills every service
        killed: list[str] = []
        try:
            if not signals.killed:
                first = ("the gateway finishes the calls in flight (at most "
                         f"{mesh.gateway_drain_grace_s():g} s), then " if mesh.is_running("gateway") else "")
                _say(signals.with_hurry_hint(f"stopping: {first}the executors, the scheduler and the kvstore stop"))
            killed = mesh.stop()
        except KeyboardInterrupt:  # Ctrl-C while stopping: its handler killed every service
            with contextlib.suppress(KeyboardInterrupt):
                mesh.stop()  # reaps them, at once
        if signals.killed:
            killed = ["every service"]
        _say_stopped(killed)
    if failed or killed:
        raise typer.Exit(1)
