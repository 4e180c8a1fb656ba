"""--metrics-port on the service commands (real processes) and the ports `meshserve up` hands out."""

import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.ports import free_port
from meshserve.grpc_server import wait_serving
from tests.support.metrics import samples
from tests.support.tls import cert_dir, role_tls


@pytest.mark.parametrize("service,args", [("scheduler", []), ("kvstore", ["--memory", "1MiB"])])
async def test_service_command_serves_metrics_on_its_port(service, args):
    port, metrics_port = free_port(), free_port()
    d = cert_dir()  # the service command over mutual TLS, as deployed
    tls = ["--tls-cert", str(d / f"{service}.pem"), "--tls-key", str(d / f"{service}-key.pem"),
           "--tls-ca", str(d / "ca.pem")]
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", service, "--port", str(port),
                             "--metrics-port", str(metrics_port), *tls, *args])
    try:
        await wait_serving(f"127.0.0.1:{port}", timeout_s=60, tls=role_tls("client"))
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            got = samples(resp.read().decode())
        assert got[("meshserve_build_info", (("service", service), ("version", "0.1.0")))] == 1.0
        expected = "meshserve_scheduler_executors" if service == "scheduler" else "meshserve_kvstore_hit_ratio"
        assert got[(expected, ())] == 0.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_metrics_port_is_range_checked():
    from typer.testing import CliRunner

    from meshserve.cli import app

    result = CliRunner().invoke(app, ["scheduler", "--metrics-port", "70000"])
    assert result.exit_code == 2 and "--metrics-port" in result.output


def test_up_gives_every_service_its_own_metrics_port():
    mesh = Mesh(MeshConfig(metrics=True))
    args = [mesh._metrics_args(name) for name in ("scheduler", "executor-0", "executor-1", "gateway")]
    assert [a[0] for a in args] == ["--metrics-port"] * 4
    assert list(mesh.metrics_addresses) == ["scheduler", "executor-0", "executor-1", "gateway"]
    assert [f"127.0.0.1:{a[1]}" for a in args] == list(mesh.metrics_addresses.values())
    assert Mesh(MeshConfig(metrics=False))._metrics_args("gateway") == []


@pytest.mark.parametrize("service", [["scheduler"], ["kvstore"], ["executor", "--scheduler", "127.0.0.1:1"]])
def test_service_on_a_busy_metrics_port_is_one_line(service):
    from typer.testing import CliRunner

    from meshserve.cli import app

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, [*service, "--insecure", "--port", str(free_port()), "--metrics-port",
                                          str(port)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert f"cannot listen on 127.0.0.1:{port} (port in use or not allowed)" in result.output
    assert "--metrics-port" in result.output
