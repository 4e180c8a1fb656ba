"""``meshserve up`` pings the gateway's Redis stores before it starts any service: a
Redis that is down, stopped or misnamed is one ``error:`` line and exit code 1 within
seconds, not a gateway failing after every executor loaded the model."""

import pytest
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli.store_check import redis_stores, stores_in_env
from tests.support.redis_server import acl_user, free_port, redis_process, redis_process_or_skip

runner = CliRunner()


def up(*flags: str):
    """``meshserve up`` on free ports with ``flags`` (its result; the services as
    ``spawned`` records them)."""
    return runner.invoke(app, ["up", "--port", "0", "--http-port", "0", *flags])


@pytest.fixture
def redis():
    yield from redis_process_or_skip()


@pytest.fixture
def paused_redis():
    """A redis-server whose port accepts connections but never answers (SIGSTOP)."""
    try:
        with redis_process() as redis:
            redis.pause()
            yield redis
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_the_stores_are_read_as_the_gateway_reads_its_flags():
    assert redis_stores(["--task-store", "memory"]) == {}
    assert redis_stores(["--task-store", "redis://a:1/0", "--result-cache", "memory"]) == {
        "--task-store": "redis://a:1/0"}
    # a --config file's [gateway] flags come after up's own: the last value wins
    assert redis_stores(["--task-store", "memory", "--result-cache", "redis://b:2/1", "--task-store",
                         "unix:///run/redis.sock"]) == {"--task-store": "unix:///run/redis.sock",
                                                        "--result-cache": "redis://b:2/1"}


def test_a_store_flag_not_given_is_read_from_its_environment_variable():
    env = {"MESHSERVE_TASK_STORE": "redis://u:pw@a:1/0", "MESHSERVE_RESULT_CACHE": "memory"}
    assert redis_stores(["--port", "1"], env) == {"--task-store": "redis://u:pw@a:1/0"}
    # a flag given wins over its variable, as the gateway reads them (typer's envvar)
    assert redis_stores(["--task-store", "memory", "--result-cache", "redis://b:2/1"], env) == {
        "--result-cache": "redis://b:2/1"}
    assert redis_stores(["--port", "1"], {"MESHSERVE_TASK_STORE": ""}) == {}


def test_the_gateway_of_up_gets_its_stores_in_its_environment_not_on_its_command_line():
    args = ["gateway", "--port", "1", "--task-store", "redis://u:pw@a:1/0", "--insecure", "--result-cache",
            "memory", "--task-store", "redis://u:pw2@c:3/0", "--drain-grace-s", "5"]
    assert stores_in_env(args, {}) == (
        ["gateway", "--port", "1", "--insecure", "--drain-grace-s", "5"],
        {"MESHSERVE_TASK_STORE": "redis://u:pw2@c:3/0", "MESHSERVE_RESULT_CACHE": "memory"})
    # a variable up inherited reaches the gateway as it is; one a flag overrides is overridden
    assert stores_in_env(["gateway", "--task-store", "memory"], {"MESHSERVE_TASK_STORE": "redis://a:1/0",
                                                                 "MESHSERVE_RESULT_CACHE": "redis://b:2/1"}) == (
        ["gateway"], {"MESHSERVE_TASK_STORE": "memory", "MESHSERVE_RESULT_CACHE": "redis://b:2/1"})


def test_a_task_store_in_the_environment_is_checked_like_the_flag(spawned, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MESHSERVE_TASK_STORE", f"redis://meshserve:s3cret-pw@127.0.0.1:{port}/0")
    result = up()
    assert result.exit_code == 1
    assert result.stderr == (f"error: --task-store redis://***@127.0.0.1:{port}/0: PING failed: Error 111 connecting "
                             f"to 127.0.0.1:{port}. Connect call failed ('127.0.0.1', {port}).\n")
    assert spawned == []


def test_a_task_store_nothing_listens_on_is_one_line_and_nothing_starts(spawned):
    port = free_port()
    result = up("--task-store", f"redis://127.0.0.1:{port}/0")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (f"error: --task-store redis://127.0.0.1:{port}/0: PING failed: Error 111 connecting to "
                             f"127.0.0.1:{port}. Connect call failed ('127.0.0.1', {port}).\n")
    assert spawned == []


def test_the_store_check_names_the_store_without_its_user_and_password(spawned):
    port = free_port()
    result = up("--task-store", f"redis://meshserve:s3cret-pw@127.0.0.1:{port}/0")
    assert result.exit_code == 1
    assert result.stderr == (f"error: --task-store redis://***@127.0.0.1:{port}/0: PING failed: Error 111 connecting "
                             f"to 127.0.0.1:{port}. Connect call failed ('127.0.0.1', {port}).\n")
    assert spawned == []


def test_a_password_with_an_unescaped_slash_is_not_quoted_by_the_url_error(spawned):
    """Found by a review: redis-py read the rest of the password as the port and quoted
    it ("Port could not be cast to integer value as 'hun'")."""
    from meshserve.urls import UNREADABLE

    result = up("--task-store", "redis://meshserve:hun/ter2@127.0.0.1:6379/0")
    assert result.exit_code == 1
    assert result.stderr == f"error: --task-store redis://***@127.0.0.1:6379/0: PING failed: {UNREADABLE}\n"
    assert "hun" not in result.stderr and spawned == []


def test_a_task_store_that_never_answers_fails_at_the_pings_bound(spawned, paused_redis):
    result = up("--task-store", paused_redis.url)
    assert result.exit_code == 1
    assert result.stderr == f"error: --task-store {paused_redis.url}: PING failed: no answer within 3 s\n"
    assert spawned == []


def test_a_database_redis_does_not_have_is_refused_before_anything_starts(spawned, redis):
    url = redis.url.rsplit("/", 1)[0] + "/99"
    result = up("--task-store", url)
    assert result.exit_code == 1
    assert result.stderr == f"error: --task-store {url}: PING failed: DB index is out of range\n"
    assert spawned == []


def test_a_task_store_whose_user_may_not_run_scripts_is_refused_before_anything_starts(spawned, redis):
    """It answers PING, and the gateway would say its task path is ready, but every
    submit would fail: ``up`` checks what the gateway's start checks."""
    url = acl_user(redis.url, "noscript", "s3cret-pw", "+@all", "-@scripting")
    result = up("--task-store", url)
    assert result.exit_code == 1
    assert result.stderr == (f"error: --task-store redis://***@127.0.0.1:{redis.port}/0: SCRIPT LOAD failed: this "
                             f"user has no permissions to run the 'script|load' command\n")
    assert spawned == []


def test_a_result_cache_in_the_config_file_is_checked_too(spawned, tmp_path):
    port = free_port()
    config = tmp_path / "mesh.toml"
    config.write_text(f'[gateway]\nresult-cache = "redis://127.0.0.1:{port}/0"\n')
    result = up("--config", str(config))
    assert result.exit_code == 1
    assert result.stderr == (f"error: --result-cache redis://127.0.0.1:{port}/0: PING failed: Error 111 "
                             f"connecting to 127.0.0.1:{port}. Connect call failed ('127.0.0.1', {port}).\n")
    assert spawned == []


def test_a_task_store_that_answers_lets_the_services_start(spawned, redis):
    result = up("--task-store", redis.url)
    assert result.exit_code == 1
    assert result.stderr == (f"warning: --task-store {redis.url}: it runs without its append-only file (appendonly "
                             f"no), so a restart of Redis loses the tasks written since its last snapshot (all of "
                             f"them without snapshots); run it with --appendonly yes --appendfsync always\n"
                             f"error: spawned scheduler\n")  # a test Redis keeps no file
    assert spawned == ["scheduler"]


def test_a_durable_task_store_starts_without_a_warning(spawned, tmp_path):
    try:
        with redis_process(persist_dir=str(tmp_path)) as redis:  # appendonly yes, appendfsync always
            result = up("--task-store", redis.url)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert (result.exit_code, result.stderr) == (1, "error: spawned scheduler\n")


@pytest.mark.parametrize("query", ["", "?protocol=2"])  # RESP3 refuses the HELLO, RESP2 answers NOAUTH
def test_a_redis_that_wants_a_password_says_so(spawned, redis, query):
    import redis as redis_py

    redis_py.Redis.from_url(redis.url).config_set("requirepass", "s3cret-pw")  # the default user needs it
    result = up("--task-store", redis.url + query)
    assert result.exit_code == 1
    assert result.stderr == (f"error: --task-store {redis.url}{query}: PING failed: this Redis needs a password: "
                             f"give it in the URL (redis://:PASSWORD@host:port/db, or "
                             f"redis://USER:PASSWORD@host:port/db for an ACL user), best in MESHSERVE_TASK_STORE or "
                             f"MESHSERVE_RESULT_CACHE, which ps does not show\n")
    assert spawned == []


@pytest.mark.parametrize("variable, flag", [("MESHSERVE_RESULT_CACHE", "--result-cache"),
                                            ("MESHSERVE_TASK_STORE", "--task-store")])
def test_a_stores_variable_wins_over_the_config_file_for_both_stores(spawned, tmp_path, monkeypatch, variable, flag):
    """Found by a review: the task store's variable won over a --config file, the result
    cache's lost to it. Which URL the store check pings says which one the gateway gets."""
    file_port, env_port = free_port(), free_port()
    config = tmp_path / "mesh.toml"
    key = flag.removeprefix("--")
    config.write_text(f'[gateway]\n{key} = "redis://127.0.0.1:{file_port}/0"\n')
    monkeypatch.setenv(variable, f"redis://127.0.0.1:{env_port}/0")
    result = up("--config", str(config))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {flag} redis://127.0.0.1:{env_port}/0: PING failed: ")
    assert spawned == []

