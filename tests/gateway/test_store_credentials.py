"""A Redis store's URL may carry a user and a password (``redis://user:secret@host/0``):
every message that names the store (an API answer, a log line, an error at start)
shows it without them (``meshserve.urls.redact_url``). Each test makes a real
redis-server fail in the way that produces the message: an ACL user refused a
command, a wrong password."""

from __future__ import annotations

import logging

from gateway.redis_task_store import RedisTaskStore
from gateway.result_store import RedisResultStore
from gateway.task_readiness import TaskStoreProbe
from gateway.task_runner import TaskRunner
from gateway.task_store_registry import open_task_store
from meshserve.errors import InvalidArgument
from tests.support.redis_server import acl_user
from tests.support.served_gateway import served_gateway

import pytest


def shown(redis_url: str) -> str:
    """How messages name the store at ``redis_url`` once it carries credentials."""
    return redis_url.replace("redis://", "redis://***@")


async def test_a_submit_the_store_refuses_is_a_503_naming_the_store_without_its_credentials(redis_url, caplog):
    url = acl_user(redis_url, "noscript-http", "s3cret-pw", "+@all", "-@scripting")
    caplog.set_level(logging.DEBUG)
    async with served_gateway(tasks=TaskRunner(RedisTaskStore(url))) as (client, _svc):
        answer = await client.post("/v1/tasks", json={"prompt": "hi", "max_tokens": 2})
    assert (answer.status_code, answer.json()["error"]["message"]) == (
        503, f"task store {shown(redis_url)}: this user has no permissions to run the 'evalsha' command")
    assert "s3cret-pw" not in caplog.text and "noscript-http" not in caplog.text


async def test_the_task_path_probe_logs_a_refused_login_without_the_credentials(redis_url, caplog):
    url = acl_user(redis_url, "probe-user", "s3cret-pw", "+@all").replace("s3cret-pw", "wrong-pw")
    store = RedisTaskStore(url)
    reports = []

    async def report(ready: bool) -> None:
        reports.append(ready)
    with caplog.at_level(logging.WARNING, logger="gateway.task_readiness"):
        assert await TaskStoreProbe(store.check, report).check() is False
    await store.close()
    assert reports == [False]
    assert [r.getMessage() for r in caplog.records] == [
        f"task path not ready: the task store does not answer (ConnectionError: task store {shown(redis_url)} "
        f"cannot be reached: invalid username-password pair or user is disabled.)"]


async def test_a_result_cache_call_the_store_refuses_is_logged_without_the_credentials(redis_url, caplog):
    url = acl_user(redis_url, "noset-cache", "s3cret-pw", "+@all", "-set")
    cache = RedisResultStore(url)
    with caplog.at_level(logging.WARNING, logger="gateway.result_store"):
        await cache.put("k" * 64, ())
    await cache.close()
    assert cache.errors == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"result cache {shown(redis_url)}: put failed (bypassed for 3.0 s): NoPermissionError: this user has no "
        f"permissions to run the 'set' command"]


def test_a_store_url_with_an_unknown_scheme_is_refused_without_its_credentials():
    with pytest.raises(InvalidArgument) as info:
        open_task_store("postgres://admin:s3cret-pw@db.internal:5432/tasks")
    assert str(info.value) == ("--task-store must be 'memory' or a redis://host:port/db URL, got "
                               "'postgres://***@db.internal:5432/tasks'")
