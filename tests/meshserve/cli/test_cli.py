"""The command line's shape: its commands, its entry points, and what ``meshserve up`` hands the gateway."""

import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest
from typer.main import get_command

from meshserve.cli import app, main
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh import mesh_config
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.store_check import stores_in_env

COMMANDS = ["scheduler", "executor", "kvstore", "gateway", "up", "demo", "generate", "bench", "sim", "task", "certs"]


def test_commands_in_help_order():
    assert list(get_command(app).commands) == COMMANDS


def test_console_script_is_main():
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    module, _, attr = pyproject["project"]["scripts"]["meshserve"].partition(":")
    assert getattr(import_module(module), attr) is main


def test_main_freezes_what_is_alive_once_the_command_is_done(monkeypatch):
    """The interpreter's exit then skips its full collections over torch's objects
    (seconds of a stopping service's exit): ``gc.freeze`` runs after the command, also
    when it ends with SystemExit, as typer's commands do."""
    import meshserve.cli

    calls = []

    def command():
        calls.append("command")
        raise SystemExit(0)

    monkeypatch.delenv("MESHSERVE_CPU_AFFINITY", raising=False)
    monkeypatch.setattr(meshserve.cli, "app", command)
    monkeypatch.setattr(meshserve.cli.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0 and calls == ["command", "freeze"]


def test_python_m_meshserve_cli_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "meshserve.cli", "--help"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0
    listed = out.stdout[out.stdout.index("\nCommands:\n"):].splitlines()[2:]
    assert [line.split()[0] for line in listed if line.strip()] == COMMANDS


def test_help_piped_at_80_columns_keeps_every_flag_name_whole():
    """Found by a review: the rich help cut long flag names (``--long-prefill-t…``) when
    its output was not a terminal; plain click help never cuts them."""
    out = subprocess.run([sys.executable, "-m", "meshserve.cli", "up", "--help"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLUMNS="80"))
    assert out.returncode == 0
    up = get_command(app).commands["up"]
    for param in up.params:
        for opt in param.opts:
            assert opt in out.stdout, opt
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


@pytest.mark.parametrize("flag", ["--result-cache-size", "--task-store"])
def test_up_and_gateway_share_the_gateway_flags(flag):
    commands = get_command(app).commands
    up, gateway = ({p.opts[0]: p for p in commands[name].params} for name in ("up", "gateway"))
    assert (up[flag].default, up[flag].help, up[flag].min) == (gateway[flag].default, gateway[flag].help,
                                                               gateway[flag].min)


def test_up_hands_result_cache_and_task_store_to_the_gateway():
    config = mesh_config(50061, 2, "default", "auto", "1GiB", [], None, None, result_cache_size=128,
                         task_store="redis://127.0.0.1:6390/2")
    assert (config.result_cache_size, config.task_store) == (128, "redis://127.0.0.1:6390/2")
    mesh = Mesh(config)
    mesh.scheduler_address = "127.0.0.1:50062"
    assert mesh._gateway_args() == ["gateway", "--port", "50061", "--scheduler", "127.0.0.1:50062",
                                    "--model", "default", "--result-cache-size", "128",
                                    "--task-store", "redis://127.0.0.1:6390/2", "--insecure"]
    # spawned with the store in its environment: a Redis password never shows in `ps`
    assert stores_in_env(mesh._gateway_args(), {}) == (
        ["gateway", "--port", "50061", "--scheduler", "127.0.0.1:50062", "--model", "default",
         "--result-cache-size", "128", "--insecure"], {"MESHSERVE_TASK_STORE": "redis://127.0.0.1:6390/2"})


def test_mesh_gateway_defaults_match_the_gateway_command():
    gateway = {p.name: p.default for p in get_command(app).commands["gateway"].params}
    config = MeshConfig()
    assert (config.result_cache_size, config.task_store) == (gateway["result_cache_size"], gateway["task_store"]) \
        == (0, "memory")
