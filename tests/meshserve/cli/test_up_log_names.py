"""``meshserve up`` without ``--log-dir``: every service writes to up's terminal, so each
log line starts with the name of the service that wrote it (``[executor-0] …``); with
``--log-dir`` (one file per service) lines carry no name."""

import time

from meshserve.cli import launcher
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.log_format import LOG_NAME_ENV


class FakePopen:
    """Records the environment a service would have been started with."""

    envs: dict[str, dict[str, str]] = {}

    def __init__(self, cmd, env, **_kwargs):
        self.args = cmd  # [python, -m, meshserve.cli, command, ...]
        FakePopen.envs[cmd[cmd.index("--executor-id") + 1] if "--executor-id" in cmd else cmd[3]] = env


def test_each_service_is_named_in_its_environment_only_when_they_share_the_terminal(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    FakePopen.envs.clear()
    monkeypatch.setenv(LOG_NAME_ENV, "up-itself")  # never passed on
    mesh = Mesh(MeshConfig(port=0, executors=2))
    mesh.scheduler_address = "127.0.0.1:1"
    mesh._spawn("scheduler", ["scheduler"])
    mesh.add_executor()
    mesh.add_executor()
    assert {name: env[LOG_NAME_ENV] for name, env in FakePopen.envs.items()} == {
        "scheduler": "scheduler", "executor-0": "executor-0", "executor-1": "executor-1"}
    FakePopen.envs.clear()
    logged = Mesh(MeshConfig(port=0, executors=1, log_dir=tmp_path))
    logged.scheduler_address = "127.0.0.1:1"
    logged.add_executor()
    assert LOG_NAME_ENV not in FakePopen.envs["executor-0"]


def test_a_service_started_by_the_launcher_names_itself_on_each_log_line(capfd):
    """A real scheduler process, its output on this test's terminal (fd 2)."""
    mesh = Mesh(MeshConfig(port=0, executors=0))
    mesh._spawn("executor-7", ["scheduler", "--port", "0", "--insecure"])  # any service: the name is the launcher's
    err = ""
    try:
        deadline = time.monotonic() + 120  # a hang bound
        while "scheduler serving on" not in err:
            assert mesh.is_running("executor-7") and time.monotonic() < deadline, err
            time.sleep(0.05)
            err += capfd.readouterr().err
    finally:
        mesh.stop()
    line = next(line for line in err.splitlines() if "scheduler serving on" in line)
    assert line.startswith("[executor-7] ") and " meshserve.cli.processes INFO scheduler serving on 127.0.0.1:" in line
