"""``meshserve up`` reads its ``--tenants`` and ``--pools`` files as the scheduler will,
before it starts any service: a missing or malformed file is a usage error of ``up``
itself (exit code 2, naming the file and what is wrong in it), not the scheduler's usage text
printed from inside the mesh after the model was loaded."""

import pytest
from typer.testing import CliRunner

from meshserve.cli import app

runner = CliRunner()
USAGE = "Usage: root up [OPTIONS]\nTry 'root up --help' for help.\n\nError: Invalid value: "  # CliRunner's prog name


@pytest.mark.parametrize("body, message", [
    (None, "[Errno 2] No such file or directory: '{path}'"),
    ('[[tenants]]\nname = "acme"\napi_keys = "key-1"\n',
     "{path}: tenants[0] (acme): 'api_keys' must be a non-empty list of non-empty strings"),
])
def test_a_bad_tenants_file_stops_up_before_any_service(tmp_path, spawned, body, message):
    path = tmp_path / "tenants.toml"
    if body is not None:
        path.write_text(body)
    result = runner.invoke(app, ["up", "--port", "0", "--http-port", "0", "--tenants", str(path)])
    assert (result.exit_code, spawned) == (2, [])
    assert result.output == USAGE + message.format(path=path) + "\n"


@pytest.mark.parametrize("flag", ["--tenants", "--pools"])
def test_a_directory_or_a_file_not_utf8_is_a_usage_error_too(tmp_path, spawned, flag):
    result = runner.invoke(app, ["up", "--port", "0", "--http-port", "0", flag, str(tmp_path)])
    assert (result.exit_code, spawned) == (2, [])
    assert result.output == USAGE + f"[Errno 21] Is a directory: '{tmp_path}'\n"
    path = tmp_path / "file.toml"
    path.write_bytes(b"\xff\xfe")
    result = runner.invoke(app, ["up", "--port", "0", "--http-port", "0", flag, str(path)])
    assert (result.exit_code, spawned) == (2, [])
    named = f"{path}: not UTF-8: " if flag == "--tenants" else f"pools file {path}: "
    assert result.output.startswith(USAGE + named + "'utf-8' codec can't decode byte 0xff in position 0")


def test_a_missing_pools_file_stops_up_before_any_service(tmp_path, spawned):
    path = tmp_path / "none.toml"
    result = runner.invoke(app, ["up", "--port", "0", "--http-port", "0", "--pools", str(path)])
    assert (result.exit_code, spawned) == (2, [])
    assert result.output == USAGE + f"[Errno 2] No such file or directory: '{path}'\n"
