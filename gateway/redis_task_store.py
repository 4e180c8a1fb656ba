"""The Redis backend of the task store (``--task-store redis://host:port/db``).

One Redis string per task, ``meshserve:task:<id>``, holding the record as JSON
(the result base64-encoded). Redis's own key expiry is the TTL: a final
transition writes the record with ``PX = ttl_s``; unfinished records carry
``unfinished_ttl_s`` (a gateway that died mid-task leaves nothing forever).
``transition`` and ``claim`` are compare-and-sets with ``WATCH``/``MULTI``/``EXEC``
(optimistic: retried when another gateway wrote the key meanwhile), so two
gateways sharing the store agree on one owner, one attempt and one final state
per task. A sorted set, ``meshserve:tasks:leases``, indexes the unfinished
tasks by the end of their owner's lease (0 when unowned), so ``claimable`` is
one ``ZRANGEBYSCORE``; it is written in the same transaction as the record.
A second sorted set, ``meshserve:tasks:callbacks``, indexes the finished tasks
whose callback is pending by the end of their delivery lease (0 when unowned),
so a delivery whose gateway died is found the same way (``claimable_callbacks``).

**A bound per tenant.** A sorted set per tenant, ``meshserve:tasks:unfinished:<tenant>``,
holds the ids of its unfinished records, each scored by the Unix ms at which its
record expires (``unfinished_ttl_s`` after its create: unfinished writes keep the
key's expiry). ``create`` is one Lua script (``_CREATE``), atomic on the server:
it drops the members whose record expired by Redis's own clock (``TIME``; the
record is written with ``PXAT`` that very score, so the member and its record
expire together), counts the rest, refuses at the bound, else writes the record,
its lease and its member (the set itself expires with its last member: a tenant
that submits no more leaves no key behind). The final transition removes the member in the same
transaction as the record's write (``_update``). So a gateway that dies between
its create and its task's end leaves a member that counts while the record is
unfinished (another gateway takes the task over and ends it) and stops counting
when the record expires, never later: nothing stays counted for ever.

Two members outlive what they count: a task ended by a gateway of the previous
version (which knew no set, during a rolling upgrade) and a record deleted or
evicted. Where it matters, at the bound, the script drops them before it
refuses: it reads the members' records (at most ``bound`` that still count, each
stale member once) and removes those gone or final, then counts again. It does
so at most once per ``SWEEP_INTERVAL_S`` (1 s, the refusal's Retry-After) and
tenant (the key ``meshserve:tasks:swept:<tenant>``), so a tenant that keeps
submitting at its bound costs Redis one such read a second. ``unfinished_count``
counts the members as they are (a stale one until the next sweep).

Durability across a Redis restart is Redis's own: the server must run with
``appendonly yes`` and ``appendfsync always`` (``deploy/compose`` and
``deploy/k8s`` ship that configuration), so an acknowledged SubmitTask's record
survives a restart. It must also run with ``maxmemory-policy noeviction``
(Redis's default): an eviction policy could drop a tenant's set, lifting its bound,
or an unfinished record, losing its task.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import asdict, fields, replace
from typing import Iterable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_connection import (StoreUnfit, durability_warning, redis_client, redis_reason, server_fields,
                                      shielded, version_of, version_unfit)
from gateway.task_store import TaskRecord, TaskState, TaskStore, tenant_bound_error
from meshserve.errors import Unavailable
from meshserve.urls import UNREADABLE, redact_url

KEY_PREFIX = "meshserve:task:"
# a Redis that does not answer (a blocked port) fails a call within these, as UNAVAILABLE
async def check_serves_tasks(client: aioredis.Redis) -> str | None:
    """Whether the Redis behind ``client`` can run the task store, checked once at start
    (a readiness poll only PINGs), from one ``INFO`` (or ``HELLO`` for a user that may
    not run INFO, ``server_fields``): its version is 6.2 or later (the create script
    writes with ``PXAT``), it is a primary, not a read-only replica, and the create
    script loads (``SCRIPT LOAD``: an ACL user without
    ``@scripting`` cannot). Without this check such a Redis passes every PING, the
    task path says ready, and every submit is refused UNAVAILABLE.

    Returns:
        ``durability_warning``'s warning, or None.

    Raises:
        StoreUnfit: it cannot; the message is the reason, one line.
        RedisError: the Redis did not answer.
    """
    fields = await server_fields(client)
    reason = version_unfit(version_of(fields))
    if reason is not None:
        raise StoreUnfit(reason)
    role = fields.get("role")
    if role is not None and role not in ("master", "primary"):  # a replica answers PING, refuses every write
        raise StoreUnfit(f"this Redis is a read-only replica (role {role}): give the task store its primary's URL")
    try:
        await client.script_load(_CREATE)
    except RedisError as exc:
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
            raise
        raise StoreUnfit(f"SCRIPT LOAD failed: {exc}") from None
    return durability_warning(fields)


PING_TIMEOUT_S = 3.0  # ``ping``'s bound: the whole check, connecting included


async def ping(url: str, timeout_s: float = PING_TIMEOUT_S, serves_tasks: bool = False) -> str | None:
    """One PING to the Redis at ``url``, tried once and bounded by ``timeout_s`` in all
    (connecting and selecting its database included): the check ``meshserve up`` makes
    before it starts anything; with ``serves_tasks``, then ``check_serves_tasks``
    (within the same bound), whose warning it returns.

    Raises:
        ConnectionError: no PONG (``PING failed: `` and redis-py's reason, or the
            timeout), or ``StoreUnfit``; the message is the reason only, for the caller
            to name the URL and the flag.
    """
    try:
        client = redis_client(url, timeout_s, timeout_s, retries=0)
    except ValueError:  # a URL redis-py cannot read (a scheme, a port)
        raise ConnectionError(f"PING failed: {UNREADABLE}") from None
    step = "PING"
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
            if serves_tasks:
                step = "the task store's check"
                return await check_serves_tasks(client)
            return None
    except StoreUnfit:
        raise
    except TimeoutError:
        raise ConnectionError(f"{step} failed: no answer within {timeout_s:g} s") from None
    except (RedisError, OSError) as exc:
        raise ConnectionError(f"{step} failed: {redis_reason(exc)}") from None
    finally:
        await client.aclose()


LEASES_KEY = "meshserve:tasks:leases"  # sorted set: unfinished task id -> lease end (Unix s; 0: unowned)
CALLBACKS_KEY = "meshserve:tasks:callbacks"  # sorted set: task id with a pending callback -> delivery lease end
UNFINISHED_PREFIX = "meshserve:tasks:unfinished:"  # + tenant: sorted set: unfinished task id -> record expiry (ms)
SWEPT_PREFIX = "meshserve:tasks:swept:"  # + tenant: present for SWEEP_INTERVAL_S after a sweep of its set
SWEEP_INTERVAL_S = 1.0  # the refusal's Retry-After: a retry after it sweeps again
HEAD_BYTES = 1024  # how much of a record a sweep reads to find its state (``encode`` writes it fourth)

# KEYS: the record, the lease index, the tenant's unfinished set, its sweep marker; ARGV:
# the record's JSON, the unfinished TTL (ms), its lease score, the bound (0: none), the
# task id, the record key prefix, the sweep interval (ms), the first final state's number.
# Returns {1, count after} (created), {0, count} (at the bound), {-1, count} (id exists).
#
# At the bound, before refusing (at most once per sweep interval and tenant), the
# sweep drops the members that no longer count: a record gone (deleted, evicted) or
# final (ended by a gateway of a version that left its member behind). It reads the
# members in set order and stops once ``bound`` of them count or the count is below the
# bound: at most ``bound`` records that count, and each stale member once. A record's
# state is read from its head as ``encode`` writes it (task_id, tenant, request_id,
# state: a match there is the top-level field, since a quote inside a JSON string is
# escaped), else, for a record no longer than its head, with cjson. A longer record
# whose head hides its state (its request id escaped past the head: 256 emoji take
# 3 KB) counts as unfinished until it expires: decoding such records whole, a caller's
# own request ids could hold Redis for most of a second at every sweep (measured: 0.68 s
# for 1,000 records of 100 KB), so the sweep never reads more than a head per record.
_CREATE = """
local function counts(key)
  local head = redis.call('GETRANGE', key, 0, %d)
  if head == '' then return false end
  local state = string.match(head, '^{"task_id":"[^"]*","tenant":"[^"]*","request_id":"[^"]*","state":(%%d+)[,}]')
  if state == nil then
    if #head == %d then return true end
    local ok, record = pcall(cjson.decode, head)
    if not ok or type(record) ~= 'table' or type(record['state']) ~= 'number' then return true end
    state = record['state']
  end
  return tonumber(state) < tonumber(ARGV[8])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. now)
local count = redis.call('ZCARD', KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, count} end
local bound = tonumber(ARGV[4])
if bound > 0 and count >= bound and redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[7]) then
  local live = 0
  while count >= bound and live < bound do
    local ids = redis.call('ZRANGE', KEYS[3], live, bound - 1)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      if counts(ARGV[6] .. id) then
        live = live + 1
      else
        redis.call('ZREM', KEYS[3], id)
        count = count - 1
      end
    end
  end
end
if bound > 0 and count >= bound then return {0, count} end
local expires = now + tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', expires)
redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[5])
redis.call('ZADD', KEYS[3], expires, ARGV[5])
local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[3], math.ceil(tonumber(last[2])))
return {1, count + 1}
""" % (HEAD_BYTES - 1, HEAD_BYTES)
_FIELDS = {f.name for f in fields(TaskRecord)}
_BYTES_FIELDS = ("result", "request")


def encode(record: TaskRecord) -> str:
    """The record as a JSON string (bytes fields in base64, state as its number)."""
    data = asdict(record)
    data["state"] = int(record.state)
    for name in _BYTES_FIELDS:
        data[name] = base64.b64encode(data[name]).decode()
    return json.dumps(data, separators=(",", ":"))


def decode(text: str | bytes) -> TaskRecord:
    """The inverse of ``encode`` (fields this gateway does not know are ignored, so a
    newer gateway's records stay readable)."""
    data = {k: v for k, v in json.loads(text).items() if k in _FIELDS}
    data["state"] = TaskState(data["state"])
    for name in _BYTES_FIELDS:
        if name in data:
            data[name] = base64.b64decode(data[name])
    return TaskRecord(**data)


class RedisTaskStore(TaskStore):
    """Task records in Redis, shared by every gateway pointed at the same database.

    Args:
        url: ``redis://host:port/db`` (any URL ``redis.asyncio.from_url`` takes).
        ttl_s: seconds a finished record lives.
        unfinished_ttl_s: seconds an unfinished record lives (default one day).

    Attributes:
        url: the URL as messages show it: without its user and password (``redact_url``).

    Errors: a Redis failure is ``Unavailable`` (the message names the store, redacted).
    """

    def __init__(self, url: str, ttl_s: float = 3600.0, unfinished_ttl_s: float = 86_400.0):
        super().__init__(ttl_s)
        self.url = redact_url(url)  # the only copy kept: the client holds the credentials
        self.unfinished_ttl_ms = max(1, int(unfinished_ttl_s * 1000))
        self._redis = redis_client(url)
        self._create = self._redis.register_script(_CREATE)

    @property
    def shared(self) -> bool:
        return True

    async def check(self) -> None:
        try:
            await self._redis.ping()
        except RedisError as exc:
            raise ConnectionError(f"task store {self.url} cannot be reached: {redis_reason(exc)}") from None

    async def check_at_start(self) -> str | None:
        await self.check()
        try:
            warning = await check_serves_tasks(self._redis)
        except StoreUnfit as exc:
            raise StoreUnfit(f"task store {self.url} cannot serve tasks: {exc}") from None
        except RedisError as exc:
            raise ConnectionError(f"task store {self.url} cannot be reached: {redis_reason(exc)}") from None
        return None if warning is None else f"task store {self.url}: {warning}"

    async def create(self, record: TaskRecord, max_unfinished: int | None = None) -> None:
        keys = [KEY_PREFIX + record.task_id, LEASES_KEY, UNFINISHED_PREFIX + record.tenant,
                SWEPT_PREFIX + record.tenant]
        args = [encode(record), self.unfinished_ttl_ms, record.lease_until if record.owner else 0.0,
                max_unfinished or 0, record.task_id, KEY_PREFIX, max(1, int(SWEEP_INTERVAL_S * 1000)),
                int(TaskState.SUCCEEDED)]
        try:
            created, count = await self._create(keys=keys, args=args)
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None
        if created == -1:
            if await self.get(record.task_id) == record:
                return  # the client retried after a lost reply: the first try landed, counted once
            raise ValueError(f"task {record.task_id!r} exists")
        if created == 0:
            raise tenant_bound_error(record.tenant, count, max_unfinished)

    async def unfinished_count(self, tenant: str) -> int:
        try:
            seconds, micros = await self._redis.time()
            return await self._redis.zcount(UNFINISHED_PREFIX + tenant, seconds * 1000 + micros // 1000, "+inf")
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None

    async def get(self, task_id: str) -> TaskRecord | None:
        try:
            text = await self._redis.get(KEY_PREFIX + task_id)
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None
        return None if text is None else decode(text)

    async def transition(self, task_id: str, from_states: Iterable[TaskState], to_state: TaskState | None,
                         fence: int | None = None, callback_fence: str | None = None,
                         **changes) -> TaskRecord | None:
        allowed = tuple(from_states)

        def change(record: TaskRecord) -> TaskRecord | None:
            if not record.allows(allowed, fence, callback_fence):
                return None
            return replace(record, state=to_state or record.state, **changes)

        return await shielded(self._update(task_id, change))

    async def claim(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        def change(record: TaskRecord) -> TaskRecord | None:
            if not record.claimable(now):
                return None
            return replace(record, owner=owner, attempt=record.attempt + 1, lease_until=now + lease_s)

        return await shielded(self._update(task_id, change))

    async def claimable(self, now: float, limit: int = 100) -> list[str]:
        return await self._due(LEASES_KEY, now, limit)

    async def _due(self, key: str, now: float, limit: int) -> list[str]:
        """Up to ``limit`` ids in the sorted set ``key`` whose lease ends by ``now``."""
        try:
            ids = await self._redis.zrangebyscore(key, "-inf", now, start=0, num=limit)
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def claim_callback(self, task_id: str, owner: str, now: float, lease_s: float) -> TaskRecord | None:
        def change(record: TaskRecord) -> TaskRecord | None:
            if not record.callback_claimable(now, owner):
                return None
            return replace(record, callback_owner=owner, callback_lease_until=now + lease_s)

        return await shielded(self._update(task_id, change))

    async def claimable_callbacks(self, now: float, limit: int = 100) -> list[str]:
        return await self._due(CALLBACKS_KEY, now, limit)

    async def _update(self, task_id: str, change) -> TaskRecord | None:
        """Reads the record, applies ``change`` (None: leave it), writes it back, as one
        optimistic transaction (``WATCH``/``MULTI``/``EXEC``, retried when another
        gateway wrote the key meanwhile); keeps the lease index in step.

        Callers shield it from cancellation: redis-py (8.1) swallows a task's cancel
        that lands inside a WATCH pipeline (the task goes on, "cancelling"), and a
        compare-and-set that was sent should complete anyway; the caller still sees
        its ``CancelledError`` at once."""
        key = KEY_PREFIX + task_id
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        text = await pipe.get(key)
                        if text is None:
                            pipe.multi()
                            pipe.zrem(LEASES_KEY, task_id)  # a record that expired
                            pipe.zrem(CALLBACKS_KEY, task_id)
                            await pipe.execute()
                            return None
                        record = change(decode(text))
                        if record is None:
                            await pipe.unwatch()
                            return None
                        pipe.multi()
                        if record.state.finished:
                            pipe.set(key, encode(record), px=max(1, int(self.ttl_s * 1000)))
                            pipe.zrem(LEASES_KEY, task_id)
                            pipe.zrem(UNFINISHED_PREFIX + record.tenant, task_id)  # its tenant's count
                        else:
                            pipe.set(key, encode(record), keepttl=True)
                            pipe.zadd(LEASES_KEY, {task_id: record.lease_until if record.owner else 0.0})
                        if record.callback_pending:
                            pipe.zadd(CALLBACKS_KEY, {task_id: record.callback_lease_until
                                                      if record.callback_owner else 0.0})
                        else:
                            pipe.zrem(CALLBACKS_KEY, task_id)
                        await pipe.execute()
                        return record
                    except WatchError:
                        continue  # another gateway wrote it meanwhile: read it again
        except RedisError as exc:
            raise Unavailable(f"task store {self.url}: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()
