"""--health-port on the service commands: a real service process over mutual TLS
answers health in plaintext on it; the flag is on every service command and range-checked."""

import signal
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli.ports import free_port
from meshserve.grpc_server import wait_serving
from meshserve.tls import PLAINTEXT
from tests.support.tls import cert_dir

SERVICES = {"scheduler": [], "kvstore": [], "gateway": ["--scheduler", "127.0.0.1:1"],
            "executor": ["--scheduler", "127.0.0.1:1"]}


@pytest.mark.parametrize("service,args", [("scheduler", []), ("kvstore", ["--memory", "1MiB"])])
async def test_service_command_answers_health_in_plaintext_on_its_health_port(service, args):
    port, health_port = free_port(), free_port()
    d = cert_dir()
    tls = ["--tls-cert", str(d / f"{service}.pem"), "--tls-key", str(d / f"{service}-key.pem"),
           "--tls-ca", str(d / "ca.pem")]
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", service, "--port", str(port),
                             "--health-port", str(health_port), *tls, *args])
    try:
        await wait_serving(f"127.0.0.1:{health_port}", timeout_s=60, tls=PLAINTEXT,
                           service=f"meshserve.v1.{'KVStore' if service == 'kvstore' else 'Scheduler'}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_every_service_command_takes_a_health_port(command):
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "--health-port" in result.output


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_health_port_is_range_checked(command):
    result = CliRunner().invoke(app, [command, *SERVICES[command], "--insecure", "--health-port", "70000"])
    assert result.exit_code == 2
    assert "--health-port" in result.output


@pytest.mark.parametrize("command", ["scheduler", "kvstore", "executor"])
def test_a_busy_health_port_stops_the_start_with_one_line(command):
    """The flag reaches the service's listener (the executor checks it before its model loads)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, [command, *SERVICES.get(command, []), "--insecure", "--port", "0",
                                          "--health-port", str(port)])
    assert result.exit_code == 1
    name = {"scheduler": "meshserve.v1.Scheduler", "kvstore": "meshserve.v1.KVStore"}.get(command, command)
    tail = "for health " if command != "executor" else ""
    assert result.stderr.splitlines()[-1] == (f"error: {name}: cannot listen on 127.0.0.1:{port} {tail}(port in use "
                                              "or not allowed); choose one with --health-port")
