"""``meshserve generate`` and ``meshserve task`` against a gateway that wants an API
key, called without one: the error says how this command sends a key, on a real
gateway (its scheduler unreachable: the key is checked first)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest_asyncio

from gateway.tenants import TenantRegistry
from tests.support.served_gateway import served_gateway

MISSING = ("missing API key: send 'x-api-key: <key>' or 'authorization: Bearer <key>' (this command sends one with "
           "--api-key KEY or MESHSERVE_API_KEY)")


@pytest_asyncio.fixture
async def keyed(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "acme"\napi_keys = ["key-acme"]\n')
    async with served_gateway(tenants=TenantRegistry.from_file(tenants)) as (_, svc):
        yield svc.address


async def meshserve(*args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHSERVE_API_KEY"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "meshserve.cli", *args, env=env,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, err.decode()


async def test_generate_without_a_key_says_how_to_send_one(keyed):
    assert await meshserve("generate", "--addr", keyed, "--insecure", "--prompt", "Hi") == (
        1, f"error: UNAUTHENTICATED: {MISSING}\n")


async def test_the_hint_comes_once_for_several_prompts(keyed):
    code, err = await meshserve("generate", "--addr", keyed, "--insecure", "--prompt", "a", "--prompt", "b")
    assert (code, err.splitlines()) == (1, [
        f"error (prompt 'a'): UNAUTHENTICATED: {MISSING}",
        f"error (prompt 'b'): UNAUTHENTICATED: {MISSING.split(' (this command')[0]}"])


async def test_task_without_a_key_says_how_to_send_one(keyed):
    assert await meshserve("task", "task-1", "--addr", keyed, "--insecure") == (
        1, f"error: UNAUTHENTICATED: {MISSING}\n")


def test_a_key_grpc_cannot_send_is_a_usage_error_naming_it_not_a_traceback():
    """A key with a non-ASCII letter or a control character (a ``\\r`` left by a key
    file) fails inside gRPC's metadata; the commands refuse it first, exit code 2."""
    from typer.testing import CliRunner

    from meshserve.cli import app

    runner = CliRunner()
    want = ("the key (from --api-key or MESHSERVE_API_KEY) must be printable ASCII; it holds a control or "
            "non-ASCII character")
    generate = ["generate", "--addr", "127.0.0.1:1", "--insecure", "--prompt", "Hi"]
    for args, env in (([*generate, "--api-key", "ключ"], {}),
                      ([*generate, "--async"], {"MESHSERVE_API_KEY": "key-acme\r"}),
                      (["task", "some-task", "--addr", "127.0.0.1:1", "--insecure"], {"MESHSERVE_API_KEY": "k\x01"})):
        result = runner.invoke(app, args, env=env)
        assert result.exit_code == 2, result.output
        assert want in " ".join(result.output.replace("│", " ").split()), result.output
        assert "Traceback" not in result.output
