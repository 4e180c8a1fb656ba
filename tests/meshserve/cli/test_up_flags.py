"""``meshserve up`` speaks for the services: its flags and a mesh config file reach the
command lines of the services it starts (the mesh is not started: ``run_mesh`` is
replaced by a recorder)."""

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli import mesh as mesh_cli
from meshserve.cli.mesh_file import read_mesh_file


@pytest.fixture
def started(monkeypatch):
    meshes = []
    monkeypatch.setattr(mesh_cli, "run_mesh", meshes.append)
    return meshes


def _up(*args):
    result = CliRunner().invoke(app, ["up", *args])
    return result


def test_up_flags_reach_each_service(started, tmp_path):
    pools = tmp_path / "pools.toml"
    pools.write_text('[[pools]]\nname = "default"\n')
    result = _up("--queue-policy", "sjf", "--device", "cpu", "--dtype", "float32", "--max-batch-wait-ms", "2.5",
                 "--block-size", "32", "--max-num-seqs", "8", "--http-port", "0", "--served-model-name", "smol",
                 "--served-model-name", "gpt-x", "--chat-template", "{{ messages }}", "--kvstore",
                 "--kvstore-memory", "256MiB")
    assert result.exit_code == 0, result.output
    [mesh] = started
    c = mesh.config
    assert c.scheduler_args == ["--queue-policy", "sjf"]
    assert c.executor_args == ["--dtype", "float32", "--kv-cache-memory", "1GiB", "--device", "cpu",
                               "--block-size", "32", "--max-num-seqs", "8", "--max-batch-wait-ms", "2.5"]
    assert c.kvstore_memory == "256MiB"
    mesh.scheduler_address = "127.0.0.1:1"
    gw = mesh._gateway_args()
    assert gw[gw.index("--block-size") + 1] == "32"  # the gateway hashes prompts in the executors' blocks
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--served-model-name"] == ["smol", "gpt-x"]
    assert gw[gw.index("--chat-template") + 1] == "{{ messages }}"
    http_port = int(gw[len(gw) - 1])
    assert gw[-2] == "--http-port" and http_port > 0 and mesh.http_address == f"127.0.0.1:{http_port}"
    assert gw.count("--http-port") == 1  # the winner, resolved, passed once


def test_up_passes_the_prefill_order_flags_to_the_executors(started):
    result = _up("--short-prefill-tokens", "0", "--long-prefill-token-threshold", "128", "--prefill-order", "arrival")
    assert result.exit_code == 0, result.output
    assert started[0].config.executor_args[2:] == ["--short-prefill-tokens", "0", "--prefill-order", "arrival",
                                                   "--long-prefill-token-threshold", "128"]


def test_up_refuses_an_unknown_prefill_order_before_starting_anything(started):
    result = _up("--prefill-order", "random")
    assert result.exit_code == 2
    assert "--prefill-order must be one of shortest, arrival, got 'random'" in " ".join(
        result.output.replace("│", " ").split())  # unwrap typer's error box
    assert started == []


def test_mesh_config_file_names_each_service_and_up_flags_win(started, tmp_path):
    config = tmp_path / "mesh.toml"
    config.write_text('[scheduler]\nqueue-policy = "priority"\nmax-queue-len = 64\n'
                      '[executor]\ndevice = "cpu"\nno-prefix-caching = true\nmax-num-seqs = 4\n'
                      '[gateway]\nhttp-port = 0\nserved-model-name = ["a", "b"]\n'
                      '[kvstore]\nmax-events = 100\n')
    result = _up("--config", str(config), "--max-num-seqs", "16", "--queue-policy", "fcfs", "--kvstore")
    assert result.exit_code == 0, result.output
    c = started[0].config
    assert c.scheduler_args == ["--queue-policy", "priority", "--max-queue-len", "64", "--queue-policy", "fcfs"]
    assert c.executor_args[2:] == ["--device", "cpu", "--no-prefix-caching", "--max-num-seqs", "4",
                                   "--max-num-seqs", "16"]
    assert c.kvstore_args == ["--max-events", "100"]
    assert c.gateway_args == ["--http-port", "0", "--served-model-name", "a", "--served-model-name", "b"]


def test_flags_given_to_up_win_over_the_file_and_the_file_over_ups_defaults(started, tmp_path):
    """Found by a docs review: the file overrode ``--kv-cache-memory``, ``--dtype``,
    ``--result-cache-size``… given to ``up``, which ``up`` passes ahead of the file."""
    config = tmp_path / "mesh.toml"
    config.write_text('[executor]\nkv-cache-memory = "256MiB"\ndtype = "bfloat16"\n'
                      '[gateway]\nresult-cache-size = 100\ntask-store = "memory"\n[kvstore]\nmemory = "64MiB"\n')
    last = lambda args, flag: [args[i + 1] for i, a in enumerate(args) if a == flag][-1]  # noqa: E731
    assert _up("--config", str(config), "--kvstore").exit_code == 0  # nothing given: the file's values
    c = started[-1].config
    assert (last(c.executor_args, "--kv-cache-memory"), last(c.executor_args, "--dtype")) == ("256MiB", "bfloat16")
    c.kvstore_memory, started[-1].scheduler_address = "1GiB", "127.0.0.1:1"
    assert last(started[-1]._gateway_args(), "--result-cache-size") == "100"
    assert last(c.kvstore_args, "--memory") == "64MiB"
    result = _up("--config", str(config), "--kvstore", "--kv-cache-memory", "512MiB", "--dtype", "float32",
                 "--result-cache-size", "5", "--kvstore-memory", "128MiB")
    assert result.exit_code == 0, result.output
    mesh = started[-1]
    mesh.scheduler_address = "127.0.0.1:1"
    c = mesh.config
    assert (last(c.executor_args, "--kv-cache-memory"), last(c.executor_args, "--dtype")) == ("512MiB", "float32")
    assert last(mesh._gateway_args(), "--result-cache-size") == "5"
    assert last(c.kvstore_args, "--memory") == "128MiB"


def test_the_files_http_port_wins_over_ups_default_and_a_given_one_over_the_file(started, tmp_path):
    config = tmp_path / "mesh.toml"
    config.write_text('[gateway]\nhttp-port = 9123\n')
    for args, expected in (((), "9123"), (("--http-port", "9124"), "9124")):
        assert _up("--config", str(config), *args).exit_code == 0
        mesh = started[-1]
        mesh.scheduler_address = "127.0.0.1:1"
        gw = mesh._gateway_args()
        assert gw[-2:] == ["--http-port", expected] and mesh.http_address == f"127.0.0.1:{expected}"
        assert gw.count("--http-port") == 1


@pytest.mark.parametrize("section, key", [("gateway", "port"), ("executor", "scheduler")])
def test_a_mesh_file_may_not_set_what_up_gives_each_service(started, tmp_path, section, key):
    config = tmp_path / "mesh.toml"
    config.write_text(f'[{section}]\n{key} = "7001"\n')
    result = _up("--config", str(config))
    assert result.exit_code == 2 and f"[{section}] {key}: up sets it for each service it starts" in result.output
    assert started == []


def test_bad_mesh_config_file_is_a_usage_error(started, tmp_path):
    config = tmp_path / "mesh.toml"
    config.write_text("[router]\nx = 1\n")
    result = _up("--config", str(config))
    assert result.exit_code == 2 and "unknown sections ['router']" in result.output
    assert started == []


def test_mesh_file_values_become_flags(tmp_path):
    config = tmp_path / "mesh.toml"
    config.write_text('[executor]\nenable = false\nratio = 0.5\n')
    assert read_mesh_file(config) == {"scheduler": [], "executor": ["--ratio", "0.5"], "gateway": [], "kvstore": []}


def test_up_help_shows_the_service_flags():
    result = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"})
    for flag in ("--queue-policy", "--pools", "--tenants", "--device", "--dtype", "--max-batch-wait-ms",
                 "--block-size", "--max-num-seqs", "--kvstore", "--http-port", "--served-model-name", "--config",
                 "--revision", "--tokenizer", "--chat-template", "--short-prefill-tokens",
                 "--long-prefill-token-threshold", "--prefill-order"):
        assert flag in result.output, flag


def test_a_short_start_budget_is_the_executors_not_the_services_start_up_timeout(started):
    """`up --autoscale 0..1 --start-budget-s 5` (found by a fresh user: the budget also
    became the scheduler's and gateway's start-up timeout, so a gateway needing 10 s
    stopped the mesh before any request): the budget reaches the scheduler and the
    executors' autoscaler; the services keep the mesh's start-up timeout."""
    result = _up("--autoscale", "0..1", "--start-budget-s", "5")
    assert result.exit_code == 0, result.output
    c = started[0].config
    assert (c.start_budget_s, c.startup_timeout_s) == (5.0, 300.0)
    assert c.scheduler_args[c.scheduler_args.index("--start-budget-s") + 1] == "5.0"


@pytest.mark.parametrize("args,message", [
    (["--autoscale", "0..1", "--start-budget-s", "inf"],
     "--start-budget-s must be a finite number of seconds, got inf"),
    (["--autoscale", "0..2", "--planner-interval-s", "nan"], "planner settings must be finite numbers"),
])
def test_non_finite_autoscale_settings_are_usage_errors(started, args, message):
    result = _up(*args)
    assert result.exit_code == 2 and started == []
    assert message in " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("flag,value", [("--start-budget-s", "30"), ("--planner-interval-s", "5"),
                                        ("--scale-down-cooldown-s", "10"),
                                        ("--executor-capacity-tokens-per-s", "100")])
def test_an_autoscaling_flag_without_autoscale_is_a_usage_error(started, flag, value):
    """Found by a fresh user: `up --executors 1 --start-budget-s 5` was accepted and ignored."""
    result = _up("--executors", "1", flag, value)
    assert result.exit_code == 2 and started == []
    assert f"{flag} applies only with --autoscale MIN..MAX" in " ".join(result.output.replace("│", " ").split())


def test_autoscaling_flags_with_autoscale_and_defaults_without_it_are_accepted(started):
    assert _up("--executors", "1").exit_code == 0
    assert _up("--autoscale", "1..2", "--planner-interval-s", "5", "--start-budget-s", "30").exit_code == 0
    assert len(started) == 2
