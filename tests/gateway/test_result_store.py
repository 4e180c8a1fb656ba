"""The result stores and coalescing, without a model: entries round-trip through a real
redis-server; identical requests in flight on two gateways (two coalescers over one
Redis) are computed once; a leader that stores nothing lets one follower lead; an
unreachable Redis is bypassed, never an error."""

from __future__ import annotations

import asyncio

import pytest

from gateway.collector import CompletedChoice
from gateway.events import ChoiceResult, FinishReason, Timings, TokenLogprob, TopLogprob, Usage
from gateway.result_cache import ResultCache
from gateway.result_store import ENTRY_PREFIX, Coalescer, MemoryResultStore, RedisResultStore
from tests.support.mesh_harness import wait_for_condition
from tests.support.redis_server import free_port

CHOICES = (
    CompletedChoice(0, "Paris.", (3, 4), (TokenLogprob(3, -0.25, (TopLogprob(3, -0.25), TopLogprob(9, -1.5))),
                                           TokenLogprob(4, -0.5)),
                    ChoiceResult("r1", 0, FinishReason.STOP, Usage(5, 2, 1, 0), Timings(0.5, 0.75, 0.25, 1.0),
                                 (1, 2, 5, 6, 7), "executor-0", "\n", (TokenLogprob(2, -3.0),))),
    CompletedChoice(1, "Rome", (8,), (), ChoiceResult("r1", 1, FinishReason.LENGTH, Usage(5, 1), Timings(0, 0, 0, 0),
                                                      (1, 2, 5, 6, 7), "executor-0")),
)


async def test_redis_entries_round_trip_and_expire(redis_url):
    store = RedisResultStore(redis_url, ttl_s=30.0)
    await store._redis.flushdb()
    assert await store.get("k" * 64) is None
    await store.put("k" * 64, CHOICES)
    assert await store.get("k" * 64) == CHOICES
    assert (store.hits, store.misses) == (1, 1)
    assert 0 < await store._redis.pttl(ENTRY_PREFIX + "k" * 64) <= 30_000
    await store.close()


async def run_flights(coalescers, key, release: asyncio.Event, computed: list, value=CHOICES):
    """One request per coalescer entry: each either replays (returns its cached choices)
    or leads (waits for ``release``, then sets ``value``)."""
    async def one(coalescer):
        async with coalescer.flight(key) as flight:
            if flight.cached is not None:
                return flight.cached
            computed.append(coalescer)
            await release.wait()
            flight.value = value
            return value
    return [asyncio.create_task(one(c)) for c in coalescers]


async def test_eight_identical_requests_on_two_gateways_are_computed_once(redis_url):
    stores = [RedisResultStore(redis_url), RedisResultStore(redis_url)]
    await stores[0]._redis.flushdb()
    a, b = Coalescer(stores[0]), Coalescer(stores[1])
    release, computed = asyncio.Event(), []
    tasks = await run_flights([a, b] * 4, "same" * 16, release, computed)
    # every request looked up once (8 misses); the other gateway's waiting leader polls again
    await wait_for_condition(lambda: stores[0].misses + stores[1].misses >= 9 and len(computed) == 1)
    release.set()
    results = await asyncio.gather(*tasks)
    assert results == [CHOICES] * 8
    assert len(computed) == 1 and a.computed + b.computed == 1
    assert await stores[0]._redis.keys("meshserve:rc:lock:*") == []
    for s in stores:
        await s.close()


async def test_a_leader_that_stores_nothing_lets_one_follower_compute():
    store = MemoryResultStore(ResultCache(8))
    c = Coalescer(store)
    release, computed = asyncio.Event(), []
    first = await run_flights([c], "k", release, computed, value=None)  # e.g. its caller went away
    await wait_for_condition(lambda: len(computed) == 1)
    rest = await run_flights([c] * 3, "k", release, computed)
    await wait_for_condition(lambda: store.misses >= 4)
    release.set()
    assert await asyncio.gather(*first) == [None]
    await wait_for_condition(lambda: len(computed) == 2)
    assert await asyncio.gather(*rest) == [CHOICES] * 3 and c.computed == 2


async def test_an_unreachable_redis_is_bypassed():
    """C39: one failed call opens the bypass window: the rest of the request and later
    ones make no Redis call until it ends; then Redis is tried again."""
    now = [100.0]
    store = RedisResultStore(f"redis://127.0.0.1:{free_port()}/0", bypass_s=1.0, clock=lambda: now[0])
    c = Coalescer(store)
    async with c.flight("k") as flight:
        assert flight.cached is None
        flight.value = CHOICES
    assert await store.get("k") is None and c.computed == 1
    assert (store.errors, store.bypassed) == (1, 4)      # get failed; lock, put, unlock, get bypassed
    now[0] += 1.0                                          # the window ended: tried (and failed) again
    assert await store.get("k") is None
    assert (store.errors, store.bypassed) == (2, 4)
    await store.close()


async def test_a_redis_that_does_not_answer_costs_a_call_at_most_its_timeout():
    """C39 (a blocked port: connections accepted, nothing answered): a lookup is a miss
    after ``op_timeout_s``, not after the client's socket timeouts and retries."""
    from tests.support.redis_server import redis_process

    try:
        with redis_process() as redis:
            store = RedisResultStore(redis.url, op_timeout_s=30.0)  # an answering Redis: no slow host runs out
            await store.put("k", CHOICES)
            redis.pause()
            store.op_timeout_s = 1.0
            try:
                lookup = asyncio.create_task(store.get("k"))
                done, _ = await asyncio.wait({lookup}, timeout=3.5)   # below the socket timeout (4 s)
                assert done and lookup.result() is None and store.errors == 1
            finally:
                redis.resume()
            store.op_timeout_s = 30.0
            store._bypass_until = float("-inf")                   # the window is over
            assert await store.get("k") == CHOICES                # the cache resumes
            await store.close()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
