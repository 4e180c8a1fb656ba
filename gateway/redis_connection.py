"""Connecting to Redis, and what a Redis must be for meshserve's stores.

``redis_client`` makes the client every store uses (bounded connect and call
timeouts, retries with back-off); ``redis_reason`` turns redis-py's errors into
one line for a caller; ``version_unfit`` and ``durability_warning`` read a
server's ``INFO`` (``server_fields``: ``HELLO`` where the user may not run
``INFO``); ``shielded`` runs a store call to its end even when its caller leaves.
The task store's own start-up check (``check_serves_tasks``, ``ping``) is in
``gateway.redis_task_store``.
"""

from __future__ import annotations

import asyncio
import re

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from meshserve.urls import UNREADABLE, redact_url

REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_TIMEOUT_S = 4.0


def redis_client(url: str, connect_timeout_s: float = REDIS_CONNECT_TIMEOUT_S, timeout_s: float = REDIS_TIMEOUT_S,
                 retries: int = 2) -> aioredis.Redis:
    """A client with bounded calls (the timeouts above) that reconnects ``retries`` more
    times on a dropped connection (a killed client, a restarted server) before failing.

    Raises:
        ValueError: a URL redis-py cannot read; the message names it redacted
            (redis-py's own may quote a piece of the password).
    """
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.02), retries) if retries else Retry(NoBackoff(), 0)
    again = {"retry_on_error": [RedisConnectionError]} if retries else {}
    try:
        return aioredis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s, retry=retry,
                                 **again)
    except ValueError:
        raise ValueError(f"{redact_url(url)}: {UNREADABLE}") from None


MIN_REDIS_VERSION = (6, 2)  # SET ... PXAT (the create script)


class StoreUnfit(ConnectionError):
    """A Redis that answers but cannot run the task store (too old, or its user may not
    run scripts); the message is the reason."""


def _version(text: str) -> tuple[int, ...]:
    """``"7.0.15"`` → ``(7, 0, 15)``; ``()`` when it has no number."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def version_unfit(version: str | None) -> str | None:
    """Why a Redis of ``version`` (``INFO server``'s ``redis_version``) cannot run the
    task store, or None when it can (6.2 or later) or its version is not known (None,
    or no number in it: the script load still checks what it can)."""
    number = _version(version or "")
    if number and number < MIN_REDIS_VERSION:
        return f"Redis {version} is older than 6.2, which the task store needs (SET ... PXAT)"
    return None


NEEDS_PASSWORD = ("this Redis needs a password: give it in the URL (redis://:PASSWORD@host:port/db, or "
                  "redis://USER:PASSWORD@host:port/db for an ACL user), best in MESHSERVE_TASK_STORE or "
                  "MESHSERVE_RESULT_CACHE, which ps does not show")


def redis_reason(exc: BaseException) -> str:
    """redis-py's reason for a failed call, said plainly where it is cryptic: a Redis
    that wants a password and got none answers NOAUTH, or refuses the client's HELLO
    ("HELLO must be called with the client already authenticated…"): ``NEEDS_PASSWORD``."""
    text = str(exc)
    if isinstance(exc, AuthenticationError) and ("HELLO must be called" in text or "NOAUTH" in text
                                                 or "Authentication required" in text):
        return NEEDS_PASSWORD
    return text


def durability_warning(fields: dict[str, object]) -> str | None:
    """Why the tasks in a Redis of ``fields`` (``server_fields``) would not survive a
    restart of it (its append-only file is off: ``INFO``'s ``aof_enabled`` is 0), or
    None (it is on, or the user may not run INFO: HELLO does not say). The store works
    either way; the deployments run ``appendonly yes`` with ``appendfsync always``."""
    if str(fields.get("aof_enabled", "1")) == "0":
        return ("it runs without its append-only file (appendonly no), so a restart of Redis loses the tasks "
                "written since its last snapshot (all of them without snapshots); run it with --appendonly yes "
                "--appendfsync always")
    return None


async def server_fields(client: aioredis.Redis) -> dict[str, object]:
    """``INFO``'s fields (its default sections: the version, the role, the persistence),
    else ``HELLO``'s (a user without ``@dangerous``, a common application ACL, may not
    run INFO; every user may run HELLO, which names the version and the role); {} when
    neither may be run. One round trip for all the start checks.

    Raises:
        RedisError: the Redis did not answer (a connection error or a timeout).
    """
    for ask in (client.info, lambda: client.execute_command("HELLO")):
        try:
            reply = await ask()
        except (RedisConnectionError, RedisTimeoutError):
            raise
        except RedisError:  # not allowed (NOPERM) or not known: try the next way
            continue
        if isinstance(reply, (list, tuple)):  # HELLO in RESP2: key, value, key, value…
            reply = dict(zip(reply[::2], reply[1::2]))
        fields = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in dict(reply).items()}
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in fields.items()}
    return {}


def version_of(fields: dict[str, object]) -> str | None:
    version = fields.get("redis_version", fields.get("version"))
    return None if version is None else str(version)


async def server_version(client: aioredis.Redis) -> str | None:
    """The server's version (``server_fields``), or None when it cannot be asked."""
    return version_of(await server_fields(client))


async def shielded(coro):
    """Awaits ``coro`` shielded from the caller's cancellation (it completes anyway;
    an error it ends with after the caller left is retrieved, not reported as lost)."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)
