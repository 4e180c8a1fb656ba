"""The ``meshserve`` command line (typer): ``app`` and its sub-commands, one module per kind.

| module | commands |
|---|---|
| ``services.py`` | ``scheduler``, ``executor``, ``kvstore``, ``gateway``: one service per process (for containers) |
| ``mesh.py`` | ``up`` (the whole mesh on loopback), ``demo`` (it answering 8 real chat prompts) |
| ``client.py`` | ``generate`` (prompts to a gateway), ``task`` (an async task's status) |
| ``tools.py`` | ``bench`` (throughput and latency), ``sim`` (scheduler simulations) |
| ``certs.py`` | ``certs`` (a development CA and a certificate per role) |
| ``options.py`` | the options and start-up helpers the commands share |

What the commands run: ``processes.py`` (each service's process: ``run_scheduler``,
``run_executor``, ``run_kvstore``, ``run_gateway``), ``launcher.py`` (``Mesh``: the
whole mesh as separate processes, for ``up``, ``demo`` and the benchmarks; it pings
the gateway's Redis stores first, ``store_check.py``) and ``demo.py``. This package and
``meshserve.bench`` are the only parts of ``meshserve`` that import services.

The commands are registered below, in the order ``meshserve --help`` lists them.
``main`` is the console script; ``python -m meshserve.cli`` runs it too (the
launcher starts each service so).
"""

from __future__ import annotations

import gc

import typer

from meshserve.cli import certs, client, mesh, services, tools
from meshserve.cli.options import MetricsPortOpt, OtlpOpt, ResultCacheSizeOpt, SampleOpt, TaskStoreOpt, TracesOpt
from meshserve.cpu_affinity import apply_from_env

__all__ = ["app", "main", "MetricsPortOpt", "OtlpOpt", "ResultCacheSizeOpt", "SampleOpt", "TaskStoreOpt", "TracesOpt"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="meshserve: LLM serving as a mesh of gRPC services.")

app.command()(services.scheduler)
app.command()(services.executor)
app.command("kvstore")(services.kvstore_cmd)
app.command()(services.gateway)
app.command()(mesh.up)
app.command()(mesh.demo)
app.command()(client.generate)
app.command()(tools.bench)
app.command()(tools.sim)
app.command("task")(client.task_command)
app.command()(certs.certs)


def main() -> None:
    """Console-script entry point (``meshserve = "meshserve.cli:main"``). First pins the
    process to ``$MESHSERVE_CPU_AFFINITY``'s cores when set (``meshserve.cpu_affinity``;
    a bad value exits with code 2 and says why).

    Once the command is done, every object still alive is frozen (``gc.freeze``): the
    interpreter's exit then skips the full garbage collections it runs while it tears
    the modules down, which over torch's and transformers' objects took 1.4 s of a
    stopped gateway's exit and 3.5 s of an executor's on a shared core (the rest of the
    exit is unchanged: atexit handlers, thread joins, flushed output;
    ``docs/deploy.md#how-long-a-stop-takes``)."""
    try:
        apply_from_env()
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    try:
        app()
    finally:
        gc.freeze()
