"""Start-up mistakes an operator can fix are one clear line, not a traceback."""

import socket

import pytest
from typer.testing import CliRunner

from executor.engine.config import EngineConfig
from meshserve.cli import app
from tests.support.redis_server import acl_user, free_port, redis_process

runner = CliRunner()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dtype="fp8"), "dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),
        (dict(device="gpu0"), "device must be a torch device such as cpu, cuda or cuda:1, got 'gpu0'"),
        (dict(attention_backend="flash"), "unknown attention backend 'flash'"),
        (dict(num_threads=0), "num_threads must be >= 1, got 0"),
    ],
)
def test_engine_config_rejects(kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**kwargs)
    assert message in str(info.value)


def test_triton_backend_needs_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    with pytest.raises(ValueError) as info:
        EngineConfig(attention_backend="triton", device="cpu")
    assert "attention backend 'triton' needs a CUDA device, not 'cpu'" in str(info.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(attention_backend="triton", device="cpu").attention_backend == "triton"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtype", "fp8"], "dtype must be auto, float32, bfloat16 or float16"),
        (["--block-size", "0"], "block_size must be >= 1, got 0"),
        (["--kv-cache-memory", "lots"], "lots"),
        (["--kvstore", "nowhere"], "--kvstore must be HOST:PORT, got 'nowhere'"),
        (["--max-buffered-outputs", "0"], "should be greater than or equal to 1"),
        (["--long-prefill-token-threshold", "-1"], "should be greater than or equal to 0"),
        (["--prefill-order", "random"], "--prefill-order must be one of shortest, arrival, got 'random'"),
        (["--no-chunked-prefill", "--long-prefill-token-threshold", "64"],
         "--long-prefill-token-threshold needs chunked prefill (it splits prompts into chunks): drop "
         "--no-chunked-prefill"),
    ],
)
def test_executor_bad_flag_is_a_usage_error(args, message):
    result = runner.invoke(app, ["executor", "--scheduler", "127.0.0.1:1", "--insecure", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in " ".join(result.output.replace("│", " ").split())  # unwrap typer's error box


def test_up_on_a_busy_port_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", str(port)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"error: port {port} on 127.0.0.1 is in use (another meshserve up?); "
                                     "choose one with --port")


def test_up_on_a_busy_http_port_is_one_line_before_anything_starts(tmp_path):
    """The HTTP port is checked with the gRPC port, not after the executor loaded its model."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", "0", "--http-port", str(port)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"error: HTTP port {port} on 127.0.0.1 is in use (another meshserve up?); "
                                     "choose one with --http-port")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--memory", "lots"], "not a byte size: 'lots'"),
        (["--memory", "0"], "--memory and --disk must be at least 1 byte"),
        (["--max-events", "0"], "should be greater than or equal to 1"),
    ],
)
def test_kvstore_bad_flag_is_a_usage_error(args, message):
    result = runner.invoke(app, ["kvstore", "--insecure", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("service", [["scheduler"], ["gateway", "--scheduler", "127.0.0.1:1"],
                                     ["executor", "--scheduler", "127.0.0.1:1"]])
def test_service_on_a_busy_port_is_one_line(service):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, [*service, "--insecure", "--port", str(port)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert f"cannot listen on 127.0.0.1:{port} (port in use or not allowed)" in result.output


@pytest.mark.parametrize("args,name", [(["up", "--port", "99999"], "--port"),
                                       (["up", "--executors", "0"], "--executors"),
                                       (["up", "--result-cache-size", "-1"], "--result-cache-size")])
def test_up_rejects_out_of_range_values(args, name):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert name in result.output


def test_up_rejects_a_bad_task_store_before_starting_anything():
    with socket.socket() as busy:  # were the store not checked first, up would fail on this port with code 1
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", str(port), "--task-store", "postgres://db"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert ("--task-store must be 'memory' or a redis://host:port/db URL, got 'postgres://db'"
            in " ".join(result.output.replace("│", " ").split()))


@pytest.mark.parametrize("args,message", [
    (["--dtype", "fp8"], "dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),
    (["--kv-cache-memory", "lots"], "not a byte size: 'lots'"),
    (["--kvstore", "--kvstore-memory", "1ZB"], "not a byte size: '1ZB'"),
])
def test_up_rejects_bad_executor_and_kvstore_flags_before_starting_anything(args, message):
    """The executors' and the kvstore's flags are checked by ``up`` itself (usage error,
    exit 2), not by a child process after the scheduler started."""
    with socket.socket() as busy:  # were the flags not checked first, up would fail on this port with code 1
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", str(port), *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize(
    "args,message",
    [
        (["--task-store", "postgres://db"], "--task-store must be 'memory' or a redis://host:port/db URL"),
        (["--task-ttl-s", "0"], "--task-ttl-s"),
        (["--result-cache-size", "-1"], "--result-cache-size"),
        (["--max-tasks", "0"], "--max-tasks"),
        (["--max-unfinished-tasks-per-tenant", "0"], "--max-unfinished-tasks-per-tenant"),
        (["--result-cache", "memcached://x"], "--result-cache must be 'memory' or a redis://host:port/db URL"),
        (["--callback-allow", "https://hooks.example.com/"], "--callback-allow needs --callback-secret-file"),
        (["--callback-allow", "ftp://x/", "--callback-secret-file", "k"], "expected http(s)://host[:port][/path]"),
        (["--task-lease-s", "0"], "--task-lease-s"),
        (["--task-max-attempts", "0"], "--task-max-attempts"),
    ],
)
def test_gateway_bad_flag_is_a_usage_error(args, message):
    result = runner.invoke(app, ["gateway", "--scheduler", "127.0.0.1:1", "--insecure", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in " ".join(result.output.replace("│", " ").split())


def test_gateway_with_an_unreachable_redis_is_one_line_without_the_urls_password():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed again: nothing listens there
    result = runner.invoke(app, ["gateway", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0",
                                 "--task-store", f"redis://meshserve:s3cret-pw@127.0.0.1:{port}/0"])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: task store redis://***@127.0.0.1:{port}/0 cannot be reached: ")
    assert "Traceback" not in result.output and "s3cret-pw" not in result.output


def test_gateway_reads_its_task_store_from_the_environment_without_the_flag(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MESHSERVE_TASK_STORE", f"redis://meshserve:s3cret-pw@127.0.0.1:{port}/0")
    result = runner.invoke(app, ["gateway", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0"])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: task store redis://***@127.0.0.1:{port}/0 cannot be reached: ")
    assert "s3cret-pw" not in result.output


def test_gateway_with_a_redis_user_that_may_not_run_scripts_is_one_line_before_the_model_loads():
    try:
        with redis_process() as redis:
            url = acl_user(redis.url, "noscript", "s3cret-pw", "+@all", "-@scripting")
            result = runner.invoke(app, ["gateway", "--scheduler", "127.0.0.1:1", "--insecure", "--port", "0",
                                         "--task-store", url])
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert result.exit_code == 1
    assert result.output == (f"error: task store redis://***@127.0.0.1:{redis.port}/0 cannot serve tasks: SCRIPT LOAD "
                             f"failed: this user has no permissions to run the 'script|load' command\n")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_scheduler_start_budget_must_be_finite_and_positive(value):
    """A NaN or infinite budget would never expire: a cold request could wait forever."""
    result = runner.invoke(app, ["scheduler", "--insecure", "--start-budget-s", value])
    assert result.exit_code == 2
    assert "start_budget_s must be a finite number of seconds > 0" in " ".join(result.output.replace("│", " ").split())
