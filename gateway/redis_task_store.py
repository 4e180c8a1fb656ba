"""The Redis backend of the task store (``--task-store redis://host:port/db``).

One Redis string per task, ``meshserve:task:<id>``, holding the record as JSON
(the result base64-encoded). Redis's own key expiry is the TTL: a final
transition writes the record with ``PX = ttl_s``; unfinished records carry
``unfinished_ttl_s`` (a gateway that died mid-task leaves nothing forever).
``transition`` is a compare-and-set with ``WATCH``/``MULTI``/``EXEC``
(optimistic: retried when another gateway wrote the key meanwhile), so two
gateways sharing the store agree on one final state per task.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, replace
from typing import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from gateway.task_store import TaskRecord, TaskState, TaskStore
from meshserve.errors import Unavailable

KEY_PREFIX = "meshserve:task:"


def encode(record: TaskRecord) -> str:
    """The record as a JSON string (result in base64, state as its number)."""
    data = asdict(record)
    data["state"] = int(record.state)
    data["result"] = base64.b64encode(record.result).decode()
    return json.dumps(data, separators=(",", ":"))


def decode(text: str | bytes) -> TaskRecord:
    """The inverse of ``encode``."""
    data = json.loads(text)
    data["state"] = TaskState(data["state"])
    data["result"] = base64.b64decode(data["result"])
    return TaskRecord(**data)


class RedisTaskStore(TaskStore):
    """Task records in Redis, shared by every gateway pointed at the same database.

    Args:
        url: ``redis://host:port/db`` (any URL ``redis.asyncio.from_url`` takes).
        ttl_s: seconds a finished record lives.
        unfinished_ttl_s: seconds an unfinished record lives (default one day).

    Errors: a Redis failure is ``Unavailable`` (the message names the store).
    """

    def __init__(self, url: str, ttl_s: float = 3600.0, unfinished_ttl_s: float = 86_400.0):
        super().__init__(ttl_s)
        self.url = url
        self.unfinished_ttl_ms = max(1, int(unfinished_ttl_s * 1000))
        self._redis = aioredis.from_url(url)

    @property
    def shared(self) -> bool:
        return True

    async def check(self) -> None:
        try:
            await self._redis.ping()
        except RedisError as exc:
            raise ConnectionError(f"task store {self.url} cannot be reached: {exc}") from None

    async def create(self, record: TaskRecord) -> None:
        try:
            created = await self._redis.set(KEY_PREFIX + record.task_id, encode(record), px=self.unfinished_ttl_ms,
                                            nx=True)
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None
        if not created:
            raise ValueError(f"task {record.task_id!r} exists")

    async def get(self, task_id: str) -> TaskRecord | None:
        try:
            text = await self._redis.get(KEY_PREFIX + task_id)
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None
        return None if text is None else decode(text)

    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState,
                         **changes) -> TaskRecord | None:
        key, allowed = KEY_PREFIX + task_id, tuple(from_states)
        ttl_ms = max(1, int(self.ttl_s * 1000)) if to_state.finished else None
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        text = await pipe.get(key)
                        if text is None:
                            return None
                        record = decode(text)
                        if record.state not in allowed:
                            return None
                        record = replace(record, state=to_state, **changes)
                        pipe.multi()
                        if ttl_ms is None:
                            pipe.set(key, encode(record), keepttl=True)
                        else:
                            pipe.set(key, encode(record), px=ttl_ms)
                        await pipe.execute()
                        return record
                    except WatchError:
                        continue  # another gateway wrote it meanwhile: read it again
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()
