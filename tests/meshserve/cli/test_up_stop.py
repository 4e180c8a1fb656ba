"""Stopping ``meshserve up``: the gateway first, with its calls in flight finished
(gRPC and HTTP alike), then the executors, then the scheduler and the kvstore; every
service in a process group of its own, so that a Ctrl-C at the terminal reaches
only ``up``."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx2 as httpx
import pytest

from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh import mesh_config
from meshserve.cli.mesh_config import MeshConfig
from meshserve.grpc_server import LIVENESS_SERVICE
from meshserve.client import build_request, channel, generate
from meshserve.v1 import gateway_pb2_grpc
from tests.support.mesh_harness import wait_for_condition


def test_stop_order_is_gateway_then_executors_then_scheduler_and_kvstore():
    mesh = Mesh(MeshConfig(port=1, gateway_args=["--drain-grace-s", "5"], executor_args=["--drain-grace-s", "7"]))
    mesh.procs = [(name, None) for name in ("kvstore", "scheduler", "executor-0", "executor-1", "gateway")]
    assert mesh.gateway_drain_grace_s() == 5.0
    assert mesh.stop_order() == [(["gateway"], 15.0), (["executor-0", "executor-1"], 17.0),
                                 (["scheduler", "kvstore"], 10.0)]
    mesh.procs = [(name, None) for name in ("scheduler", "executor-0", "gateway")]  # no kvstore; defaults
    mesh.config = MeshConfig(port=1)
    assert mesh.stop_order() == [(["gateway"], 40.0), (["executor-0"], 40.0), (["scheduler"], 10.0)]


CHILD = """
import signal, sys, time
name, path, obey = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def on_term(*_):
    open(path, "a").write(name + "\\n")
    if obey:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(path + "." + name, "w").close()
while True:
    time.sleep(0.05)
"""


def test_stop_in_order_signals_tier_by_tier_and_kills_and_names_what_outlives_its_bound(tmp_path):
    """The gateway ignores SIGTERM here: it is killed after its bound (and named); the
    executors get SIGTERM only then, the scheduler and kvstore last."""
    from meshserve.cli.stop_order import stop_in_order, stop_order

    log = tmp_path / "sigterms"
    names = ["kvstore", "scheduler", "executor-0", "executor-1", "gateway"]
    procs = {n: subprocess.Popen([sys.executable, "-c", CHILD, n, str(log), "0" if n == "gateway" else "1"])
             for n in names}
    try:
        for n in names:  # each has its handler installed
            deadline = time.monotonic() + 60
            while not (tmp_path / f"sigterms.{n}").exists():
                assert time.monotonic() < deadline
                time.sleep(0.02)
        order = stop_order(names, 0.5, 30.0)
        # the gateway's bound: 3 s, not its grace + 10 s; it must still log its SIGTERM before the
        # SIGKILL, which a loaded host slow to run its handler did not always do within 0.5 s
        order[0] = (order[0][0], 3.0)
        assert stop_in_order(procs, order) == ["gateway"]
        received = log.read_text().split()
        assert received[0] == "gateway" and set(received[1:3]) == {"executor-0", "executor-1"}
        assert set(received[3:]) == {"scheduler", "kvstore"} and len(received) == 5
        assert procs["gateway"].returncode == -signal.SIGKILL
        assert all(procs[n].returncode == 0 for n in names[:-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_second_ctrl_c_while_stopping_kills_every_service_and_is_raised(tmp_path):
    """Ctrl-C (KeyboardInterrupt, here from a SIGALRM handler) while ``stop_in_order``
    waits for a gateway that drains for a minute: every service is killed, none left."""
    from meshserve.cli.stop_order import stop_in_order, stop_order

    names = ["scheduler", "executor-0", "gateway"]
    procs = {n: subprocess.Popen([sys.executable, "-c", CHILD, n, str(tmp_path / "log"), "0"]) for n in names}

    def ctrl_c(*_):
        raise KeyboardInterrupt

    def ctrl_c_once_the_gateway_is_stopping():
        """SIGALRM (the Ctrl-C) once the gateway has logged its SIGTERM, not after a fixed
        time: a loaded host may run the gateway's handler late, or kill it first."""
        log, deadline = tmp_path / "log", time.monotonic() + 60  # a hang bound
        while not (log.exists() and log.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        for n in names:
            deadline = time.monotonic() + 60
            while not (tmp_path / f"log.{n}").exists():
                assert time.monotonic() < deadline
                time.sleep(0.02)
        threading.Thread(target=ctrl_c_once_the_gateway_is_stopping, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            stop_in_order(procs, stop_order(names, 60.0, 60.0))
        assert (tmp_path / "log").read_text().split() == ["gateway"]  # only the first tier was asked
        assert {n: p.returncode for n, p in procs.items()} == {n: -signal.SIGKILL for n in names}
    finally:
        signal.signal(signal.SIGALRM, previous)
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_mesh_starts_services_from_the_main_thread_only():
    """A service is stopped when the thread that started it ends (``stop_with_parent``):
    a worker thread is refused before anything starts."""
    import threading

    mesh, errors = Mesh(MeshConfig(port=0)), []
    thread = threading.Thread(target=lambda: errors.append(_raised(lambda: mesh._spawn("scheduler", ["--help"]))))
    thread.start()
    thread.join(60)
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0]) and mesh.procs == []


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


MAX_TOKENS = 160  # long enough that both calls are still streaming when the stop begins


@pytest.mark.model
async def test_stop_lets_the_calls_in_flight_finish_before_the_mesh_goes(tmp_path):
    config = mesh_config(0, 1, "default", "float32", "256MiB", [], None, str(tmp_path), http_port=0,
                         gateway_args=["--drain-grace-s", "120"])
    mesh = Mesh(config)
    await mesh.start()
    procs = dict(mesh.procs)
    try:
        assert all(os.getpgid(p.pid) == p.pid for p in procs.values())  # a group each: Ctrl-C reaches only up
        async with channel(mesh.gateway_address) as ch, httpx.AsyncClient(base_url=f"http://{mesh.http_address}",
                                                                            timeout=None) as http:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            grpc_tokens: list[int] = []
            grpc_call = asyncio.create_task(generate(
                stub, build_request("Tell me a long story.", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                on_delta=lambda _text, ids: grpc_tokens.extend(ids)))
            http_events: list[dict] = []

            async def http_stream():
                body = {"model": model, "messages": [{"role": "user", "content": "Count to a thousand."}],
                        "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            http_events.append(json.loads(line[6:]))

            http_call = asyncio.create_task(http_stream())
            await wait_for_condition(lambda: grpc_tokens and len(http_events) > 1, what="both calls streaming")
            stopping = asyncio.create_task(asyncio.to_thread(mesh.stop))
            out = await grpc_call
            await http_call
            await stopping
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS == len(grpc_tokens)
        assert http_events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert [e["choices"][0]["finish_reason"] for e in http_events if e["choices"]][-1] == "length"
        assert {name: p.returncode for name, p in procs.items()} == {name: 0 for name in procs}
        gateway_log = (tmp_path / "gateway.log").read_text()
        assert "release of lease" not in gateway_log  # the scheduler was still up for every Release
        assert "gateway stopping: new calls refused, 120 s for the calls in flight and the running tasks" in gateway_log
    finally:
        mesh.stop()


@pytest.mark.model
async def test_a_call_after_the_gateway_began_stopping_is_unavailable(tmp_path):
    config = mesh_config(0, 1, "default", "float32", "256MiB", [], None, str(tmp_path),
                         gateway_args=["--drain-grace-s", "120"])
    mesh = Mesh(config)
    await mesh.start()
    procs = dict(mesh.procs)
    try:
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            tokens: list[int] = []
            long_call = asyncio.create_task(generate(
                stub, build_request("Tell me a long story.", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                on_delta=lambda _text, ids: tokens.extend(ids)))
            await wait_for_condition(lambda: tokens, what="the long call streaming")
            stopping = asyncio.create_task(asyncio.to_thread(mesh.stop))
            await _wait_refused(mesh.gateway_address)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, build_request("Hello", max_tokens=4), timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len((await long_call).token_ids) == MAX_TOKENS
            await stopping
        assert {name: p.returncode for name, p in procs.items()} == {name: 0 for name in procs}
    finally:
        mesh.stop()


async def _wait_refused(address: str) -> None:
    """Polls the gateway's grpc.health.v1 until the call itself is refused (UNAVAILABLE):
    the server has begun its graceful stop."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120  # a hang bound
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return
            assert loop.time() < deadline, "the gateway never refused a call"
            await asyncio.sleep(0.02)


def _start_up(log_dir) -> subprocess.Popen:
    """``meshserve up`` with one float32 executor, its lines on a pipe, in a session of
    its own (a terminal's foreground process group holds it alone)."""
    return subprocess.Popen([sys.executable, "-m", "meshserve.cli", "up", "--port", "0",
                             "--executors", "1", "--dtype", "float32", "--kv-cache-memory", "256MiB", "--no-metrics",
                             "--http-port", "0", "--log-dir", str(log_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_all(up: subprocess.Popen, services: list[int]) -> None:
    """SIGKILL to ``up``'s process group and each service's (a no-op for those gone), then reaps ``up``."""
    for pid in [up.pid, *services]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    up.wait()


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115 - read at once
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _gone(pid: int) -> bool:
    """The process exited (reaped, or a zombie nobody reaped yet)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - read at once
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


STOPPING = ("stopping: the gateway finishes the calls in flight (at most 30 s), then the executors, the scheduler and "
            "the kvstore stop; ")
HURRY = {"ctrl-c at the terminal": "Ctrl-C again kills every service",
         "terminal closed": "another SIGHUP changes nothing; Ctrl-C (SIGINT) kills every service",
         "kill -TERM": "another SIGTERM changes nothing; Ctrl-C (SIGINT) kills every service"}


@pytest.mark.model
@pytest.mark.parametrize("how", ["ctrl-c at the terminal", "terminal closed", "kill -TERM", "up killed"])
def test_up_stopped_from_its_terminal_stops_every_service_in_order(how, tmp_path):
    """Ctrl-C sends SIGINT to the terminal's foreground process group, which holds
    ``up`` alone; a closed terminal sends ``up`` SIGHUP, which the services, in groups
    of their own, never get. Either way, and on a SIGTERM, ``up`` stops them all in
    order and exits 0, its stop line saying what a further signal does (a SIGHUP or a
    SIGTERM used to be told "Ctrl-C again"). ``up`` SIGKILLed stops nothing itself:
    each service gets SIGTERM from Linux (``stop_with_parent``) and exits, none is left
    holding its ports."""
    up = _start_up(tmp_path)
    services: list[int] = []
    try:
        lines = []
        deadline = time.monotonic() + 300  # a hang bound (the model loads)
        while not any(line.startswith("meshserve is up") for line in lines):
            assert up.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(up.stdout.readline())
        services = _children(up.pid)
        assert len(services) == 3  # scheduler, executor-0, gateway
        assert all(os.getpgid(pid) == pid for pid in services)
        if how == "up killed":
            up.kill()
            up.wait()
            deadline = time.monotonic() + 120  # a hang bound
            while not all(_gone(pid) for pid in services):
                assert time.monotonic() < deadline, [pid for pid in services if not _gone(pid)]
                time.sleep(0.05)
            return
        if how == "ctrl-c at the terminal":
            os.killpg(up.pid, signal.SIGINT)  # the foreground group: up alone
        else:
            up.send_signal(signal.SIGHUP if how == "terminal closed" else signal.SIGTERM)
        rest, _ = up.communicate(timeout=300)
        assert up.returncode == 0, "".join(lines) + rest
        assert STOPPING + HURRY[how] in rest.splitlines()
        assert rest.rstrip().endswith("meshserve stopped.")
        for pid in services:  # every service exited (and was reaped by up)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        services = services or _children(up.pid)  # up may have failed before the test listed them
        _kill_all(up, services)  # a failed test leaves no process behind


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_start_up_stops_the_services_started_so_far_at_once(sig, tmp_path):
    """The signal comes while the executor starts (its log file is there, the model is
    not loaded): ``up`` says start-up was interrupted, stops the scheduler and the
    executor in order and exits 0 as after any stop; the gateway never starts. (It
    used to finish the start first, gateway and all, for a SIGTERM or a SIGHUP: ~40 s
    with the model load on a loaded host.)"""
    up = _start_up(tmp_path)
    services: list[int] = []
    try:
        deadline = time.monotonic() + 300  # a hang bound
        while len(services) < 2:  # the scheduler, and the executor, which starts loading the model
            assert up.poll() is None and time.monotonic() < deadline, up.stdout.read()
            time.sleep(0.01)
            services = _children(up.pid)
        assert (tmp_path / "executor-0.log").exists()
        if sig == signal.SIGINT:
            os.killpg(up.pid, sig)  # Ctrl-C: the foreground group, up alone
        else:
            up.send_signal(sig)
        out, _ = up.communicate(timeout=300)
        how = "Ctrl-C" if sig == signal.SIGINT else sig.name
        hurry = HURRY["ctrl-c at the terminal" if sig == signal.SIGINT else "kill -TERM"].replace("SIGTERM", sig.name)
        assert up.returncode == 0, out
        assert out.splitlines()[-2:] == [f"start-up interrupted ({how}): stopping executor-0, scheduler, in order; "
                                         f"{hurry}", "meshserve stopped."]
        assert "meshserve is up" not in out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["executor-0.log", "scheduler.log"]  # no gateway
        for pid in services:  # every service exited (and was reaped by up)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        _kill_all(up, services)  # a failed test leaves no process behind


async def test_a_service_that_exits_during_start_up_is_named_with_the_end_of_its_log(tmp_path):
    mesh = Mesh(MeshConfig(port=0, executors=0, log_dir=tmp_path, scheduler_args=["--no-such-flag"]))
    with pytest.raises(RuntimeError) as info:
        await mesh.start()
    message = str(info.value)
    assert message.startswith(f"scheduler exited with code 2 during start-up; {tmp_path / 'scheduler.log'} ends:\n")
    assert "No such option: --no-such-flag" in message
    assert mesh.gateway_address == ""  # port 0: the gateway's port is chosen only when it starts


@pytest.mark.model
async def test_port_zero_gives_the_gateway_a_port_chosen_when_it_starts(tmp_path):
    mesh = Mesh(MeshConfig(port=0, executors=0, log_dir=tmp_path))
    assert mesh.gateway_address == ""
    try:
        await mesh.start()
        port = mesh.command_lines()["gateway"][mesh.command_lines()["gateway"].index("--port") + 1]
        assert mesh.gateway_address == f"127.0.0.1:{port}" and mesh.config.port == int(port)
        async with channel(mesh.gateway_address) as ch:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        mesh.stop()
