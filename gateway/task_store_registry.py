"""The task stores by ``--task-store`` value: ``memory`` or a Redis URL.

The registry imports its plug-ins (``gateway.task_store.MemoryTaskStore``,
``gateway.redis_task_store.RedisTaskStore``); the interface module imports none.
"""

from __future__ import annotations

from gateway.redis_task_store import RedisTaskStore
from gateway.task_store import MemoryTaskStore, TaskStore
from meshserve.errors import InvalidArgument
from meshserve.urls import redact_url


def open_task_store(url: str, ttl_s: float = 3600.0, max_tasks: int = 10_000) -> TaskStore:
    """The store a ``--task-store`` value names: ``memory`` or ``redis://host:port/db``.

    Args:
        url: ``memory`` (default), or a Redis URL (``redis://``, ``rediss://``, ``unix://``).
        ttl_s: seconds a finished task lives (``--task-ttl-s``).
        max_tasks: the memory store's bound (``--max-tasks``).

    Raises:
        InvalidArgument: an unknown scheme, or a TTL or bound out of range.
    """
    if task_store_kind(url) == "memory":
        return MemoryTaskStore(ttl_s, max_tasks)
    return RedisTaskStore(url, ttl_s)


def task_store_kind(url: str) -> str:
    """``memory`` or ``redis``: the backend a ``--task-store`` value names.

    Raises:
        InvalidArgument: neither ``memory`` nor a ``redis://``, ``rediss://`` or ``unix://`` URL.
    """
    if url == "memory":
        return "memory"
    if url.split("://", 1)[0] in ("redis", "rediss", "unix") and "://" in url:
        return "redis"
    raise InvalidArgument(f"--task-store must be 'memory' or a redis://host:port/db URL, got {redact_url(url)!r}")
