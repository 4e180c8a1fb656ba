"""The command line's shape: its commands and its entry points."""

import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

from typer.main import get_command

from meshserve.cli import app, main

COMMANDS = ["scheduler", "executor", "kvstore", "gateway", "up", "demo", "generate", "bench", "sim", "task"]


def test_commands_in_help_order():
    assert list(get_command(app).commands) == COMMANDS


def test_console_script_is_main():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    module, _, attr = pyproject["project"]["scripts"]["meshserve"].partition(":")
    assert getattr(import_module(module), attr) is main


def test_python_m_meshserve_cli_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "meshserve.cli", "--help"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0
    panel = out.stdout[out.stdout.index("─ Commands ─"):].splitlines()
    assert [line.split()[1] for line in panel if line.startswith("│")] == COMMANDS
