"""Where the gateway core keeps result-cache entries, and how identical requests in
flight are computed once (coalesced).

``ResultStore`` is a small async interface with two backends:

* ``MemoryResultStore``: the in-process LRU (``gateway.result_cache.ResultCache``),
  one gateway (``--result-cache-size N``; the default).
* ``RedisResultStore``: ``--result-cache redis://host:port/db``, shared by every
  gateway pointed at it. An entry is ``meshserve:rc:<key>`` (the hex key of
  ``cache_key``: neither prompt nor tenant can be read from it) holding the
  choices as a serialized ``TaskStatus`` (protobuf, never pickle), with Redis's
  own expiry as the TTL (``PX``).

**Coalescing** (``Coalescer.flight``). The first request for a key on a gateway
*leads*: it computes; later identical requests on the same gateway wait for its
result (an ``asyncio.Future``). Across gateways the leader also takes a lock
(``SET meshserve:rc:lock:<key> <owner> NX PX lock_s``); a gateway that finds
the lock taken polls the entry (5 ms, doubling to 100 ms) until it appears, the
lock goes away without one (the leader failed: it leads itself), or
``wait_s`` passes (it computes without the lock). A leader whose output is not
cacheable (aborted, cancelled, an error) stores nothing; its followers then
compute (one of them leads again). Followers are answered from the cache
(``cached`` set), exactly as a later hit would be.

Redis failures never fail a request: a lookup is a miss, a store or a lock is
skipped (logged, counted in ``errors``). Each Redis call is bounded by
``op_timeout_s`` (a Redis that does not answer, e.g. a blocked port, costs a
request at most that); after a failure the cache is bypassed outright for
``bypass_s`` (no call is made; counted in ``bypassed``), then tried again, so
during an outage synchronous requests run uncached at full speed and the cache
resumes by itself once Redis answers.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from gateway.collector import CompletedChoice
from gateway.proto_convert import task_result, task_result_choices
from gateway.redis_connection import redis_client, redis_reason, shielded
from gateway.result_cache import ResultCache
from meshserve.urls import redact_url

log = logging.getLogger(__name__)

Choices = tuple[CompletedChoice, ...]
ENTRY_PREFIX = "meshserve:rc:"
LOCK_PREFIX = "meshserve:rc:lock:"
_UNLOCK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class ResultStore(abc.ABC):
    """Finished choices by ``cache_key``; the cross-gateway lock of a key.

    Attributes:
        hits / misses: lookups that found / did not find an entry.
    """

    hits = 0
    misses = 0

    async def peek(self, key: str) -> bool:
        """Whether an entry is there now (not counted as a hit or a miss)."""
        return await self._get(key) is not None

    async def get(self, key: str) -> Choices | None:
        """The entry, or None (absent, expired, or the store unreachable)."""
        value = await self._get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    @abc.abstractmethod
    async def _get(self, key: str) -> Choices | None: ...

    @abc.abstractmethod
    async def put(self, key: str, value: Sequence[CompletedChoice]) -> None:
        """Stores an entry (its TTL starts now)."""

    async def lock(self, key: str, owner: str) -> bool:
        """Takes the key's computing lock for ``owner``; False when another gateway holds it.
        (One process needs none: its own futures coalesce.)"""
        return True

    async def locked(self, key: str) -> bool:
        """Whether some gateway holds the key's lock."""
        return False

    async def unlock(self, key: str, owner: str) -> None:
        """Releases ``owner``'s lock (never another's)."""

    async def close(self) -> None:
        """Releases connections."""


class MemoryResultStore(ResultStore):
    """The in-process LRU with a TTL (``ResultCache``)."""

    def __init__(self, cache: ResultCache[Choices]):
        self.cache = cache

    async def _get(self, key: str) -> Choices | None:
        return self.cache.get(key)

    async def put(self, key: str, value: Sequence[CompletedChoice]) -> None:
        self.cache.put(key, tuple(value))


class RedisResultStore(ResultStore):
    """Entries in Redis, shared by gateways (see the module docstring).

    Args:
        url: ``redis://host:port/db``; kept (``url``) and logged without its user and
            password (``redact_url``).
        ttl_s: seconds an entry lives (> 0).
        lock_s: how long a computing lock lives if its leader dies (seconds).
        op_timeout_s: one Redis call's bound (seconds): far above a healthy call on a
            loaded machine (a false timeout costs a recomputation), far below the
            client's own socket timeouts and retries.
        bypass_s: after a failed call, how long the cache is skipped (seconds).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, url: str, ttl_s: float = 600.0, lock_s: float = 120.0, op_timeout_s: float = 2.0,
                 bypass_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0 or not lock_s > 0 or not op_timeout_s > 0 or bypass_s < 0:
            raise ValueError(f"result cache TTL, lock time and call timeout must be > 0 s, got {ttl_s}, {lock_s}, "
                             f"{op_timeout_s}")
        self.url = redact_url(url)  # as logged: without its user and password
        self.ttl_ms, self.lock_ms = max(1, int(ttl_s * 1000)), max(1, int(lock_s * 1000))
        self.op_timeout_s, self.bypass_s, self.clock = op_timeout_s, bypass_s, clock
        self._redis = redis_client(url)
        self._unlock = self._redis.register_script(_UNLOCK)
        self.errors = 0
        self.bypassed = 0
        self._bypass_until = float("-inf")

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        self._bypass_until = self.clock() + self.bypass_s
        log.warning("result cache %s: %s failed (bypassed for %.1f s): %s", self.url, what, self.bypass_s,
                    f"{type(exc).__name__}: {redis_reason(exc)}")

    async def _call(self, what: str, call: Callable[[], Awaitable], failed):
        """``await call()`` bounded by ``op_timeout_s``; ``failed`` (and the bypass
        window) when it fails, or at once inside the window."""
        if self.clock() < self._bypass_until:
            self.bypassed += 1
            return failed
        try:
            async with asyncio.timeout(self.op_timeout_s):  # no extra task, unlike wait_for
                return await shielded(call())
        except (RedisError, TimeoutError) as exc:
            self._failed(what, exc)
            return failed

    async def _get(self, key: str) -> Choices | None:
        data = await self._call("get", lambda: self._redis.get(ENTRY_PREFIX + key), None)
        if data is None:
            return None
        try:
            return tuple(task_result_choices(data))
        except DecodeError as exc:
            self._failed("decode", exc)
            return None

    async def put(self, key: str, value: Sequence[CompletedChoice]) -> None:
        data = task_result(value)
        await self._call("put", lambda: self._redis.set(ENTRY_PREFIX + key, data, px=self.ttl_ms), None)

    async def lock(self, key: str, owner: str) -> bool:
        # failed: no Redis, no one to coalesce with: compute
        return bool(await self._call("lock", lambda: self._redis.set(LOCK_PREFIX + key, owner, nx=True,
                                                                    px=self.lock_ms), True))

    async def locked(self, key: str) -> bool:
        return bool(await self._call("lock check", lambda: self._redis.exists(LOCK_PREFIX + key), False))

    async def unlock(self, key: str, owner: str) -> None:
        await self._call("unlock", lambda: self._unlock(keys=[LOCK_PREFIX + key], args=[owner]), None)

    async def close(self) -> None:
        await self._redis.aclose()


@dataclass
class Flight:
    """One request's part in a key's computation.

    Attributes:
        cached: the answer, when the cache (or a leader) had it: replay it.
        value: a leader sets the choices it computed, when cacheable.
    """

    cached: Choices | None = None
    value: Choices | None = None


class Coalescer:
    """Looks a key up and coalesces identical requests (see the module docstring).

    Args:
        store: the result store.
        wait_s: the longest a request waits for another gateway's leader (seconds).
        poll_s: the first poll interval of that wait (doubling up to 100 ms).
    """

    def __init__(self, store: ResultStore, wait_s: float = 120.0, poll_s: float = 0.005):
        self.store, self.wait_s, self.poll_s = store, wait_s, poll_s
        self.owner = uuid.uuid4().hex
        self._leaders: dict[str, asyncio.Future] = {}
        self.computed = 0  # flights this gateway led (computed), for tests and metrics

    @asynccontextmanager
    async def flight(self, key: str) -> AsyncIterator[Flight]:
        """Yields a ``Flight``: ``cached`` set (replay it), or this request leads (compute,
        then set ``value`` when the output may be cached; it is stored on exit)."""
        while True:
            cached = await self.store.get(key)
            if cached is not None:
                yield Flight(cached=cached)
                return
            leader = self._leaders.get(key)
            if leader is not None:  # the same request runs on this gateway: wait for it
                value = await shielded(leader)
                if value is not None:
                    yield Flight(cached=value)
                    return
                continue  # it stored nothing: look again (and lead)
            break
        future = asyncio.get_running_loop().create_future()
        self._leaders[key] = future
        flight = Flight()
        try:
            if not await self.store.lock(key, self.owner):
                flight.cached = await self._wait_elsewhere(key)
            if flight.cached is None:
                self.computed += 1
            yield flight
            if flight.value is not None:
                await self.store.put(key, flight.value)
        finally:
            del self._leaders[key]
            future.set_result(flight.cached or flight.value)
            await self.store.unlock(key, self.owner)

    async def _wait_elsewhere(self, key: str) -> Choices | None:
        """Polls for another gateway's result; None when its lock went away without one
        (after one more try for the lock) or ``wait_s`` passed."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.wait_s, self.poll_s
        while loop.time() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
            cached = await self.store.get(key)
            if cached is not None:
                return cached
            if not await self.store.locked(key) and await self.store.lock(key, self.owner):
                return None  # its leader failed: this one leads now
        return None
