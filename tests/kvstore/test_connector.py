"""The executor's KVStoreConnector against a real kvstore service, without a model:
publish then fetch round-trips exact bytes; a fetch cancelled mid-transfer releases
its leases and never reports, nor does one cancelled after it finished (a retry under
the same id gets only its own result); a store that is down gives an empty result."""

from __future__ import annotations

import asyncio
import time

import torch

from executor.kvstore_connector import KVStoreConnector
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint
from tests.support.served_kvstore import STALL_S, DelayingServicer, ServedKVStore

FP = KVStoreFingerprint(ModelFingerprint("m", "r"), KVLayout(4, 2, 2, 8, "float32"))  # 1 KiB blocks
SHAPE = (2, 2, 4, 2, 8)


HANG_S = 120.0  # the waits' bound: it only stops a hang


def payload(kv: torch.Tensor) -> bytes:
    """A block's payload: its raw bytes (what ``KVConnectorWorker.save_kv`` gives)."""
    return kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def poll_until(connector: KVStoreConnector, timeout_s: float = HANG_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = connector.poll()
        if results:
            return results
        time.sleep(0.005)
    raise TimeoutError("no fetch result")


def test_publish_then_fetch_roundtrip():
    served = ServedKVStore(KVStore(memory_bytes=1 << 20))
    conn = KVStoreConnector(served.address, FP)
    woken = []
    conn.set_waker(lambda: woken.append(1))
    try:
        blocks = [(10 + i, torch.arange(256, dtype=torch.float32).view(SHAPE) * (i + 1)) for i in range(3)]
        conn.publish([(h, payload(kv)) for h, kv in blocks])
        conn.flush()
        assert conn.is_known(10) and not conn.is_known(99)
        s = conn.stats()
        assert (s.published_blocks, s.bytes_out, s.publish_dropped_blocks) == (3, 3 * FP.block_bytes, 0)
        conn.start_fetch("req-1", 4, [10, 11, 12, 13])
        [result] = poll_until(conn)
        assert (result.request_id, result.start_block, result.num_requested) == ("req-1", 4, 4)
        assert [torch.frombuffer(p, dtype=torch.float32).view(SHAPE).equal(kv) for p, (_, kv) in
                zip(result.payloads, blocks)] == [True, True, True]
        s = conn.stats()
        assert (s.fetches, s.fetched_blocks, s.fetch_failures, s.bytes_in) == (1, 3, 0, 3 * FP.block_bytes)
        assert woken == [1] and conn._fetches == {}
        assert not conn.is_known(13)          # asked for and missing: publish it when computed
        assert served.stats().num_leases == 0
    finally:
        conn.close()
        served.stop()


def test_publish_queue_is_bounded():
    served = ServedKVStore(KVStore(memory_bytes=1 << 20))
    conn = KVStoreConnector(served.address, FP, max_publish_bytes=2 * FP.block_bytes)
    try:
        kv = payload(torch.zeros(SHAPE))
        conn.publish([(1, kv), (2, kv), (3, kv)])   # 3 KiB > 2 KiB: dropped at once, never waits
        conn.publish([(4, kv)])
        conn.flush()
        s = conn.stats()
        assert (s.publish_dropped_blocks, s.published_blocks) == (3, 1)
    finally:
        conn.close()
        served.stop()


def fetch_tasks(connector: KVStoreConnector) -> list:
    """The connector's fetch coroutines still alive on its I/O loop (a fetch that
    reports puts its result before it ends)."""
    async def alive():
        return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "KVStoreConnector._fetch"]
    return connector._call(alive())


def wait_until(predicate) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_block_the_store_had_no_room_for_is_offered_again():
    """Found by a review: a block refused for lack of room (leased blocks fill the
    store) stayed "known" to its publisher, which never offered it again."""
    fp = KVStoreFingerprint(ModelFingerprint("m", "r"), KVLayout(4, 1, 1, 2, "float32"))
    served = ServedKVStore(KVStore(memory_bytes=fp.block_bytes))  # room for one block
    connector = KVStoreConnector(served.address, fp)
    try:
        connector.publish([(1, b"\x01" * fp.block_bytes)])
        connector.flush()

        async def pin():
            return served.store.acquire("reader", fp.namespace, [1])  # a Get streams block 1

        assert served.call(pin()) == 1
        connector.publish([(2, b"\x02" * fp.block_bytes)])
        connector.flush()
        assert (connector.stats().publish_dropped_blocks, connector.is_known(1), connector.is_known(2)) == (
            1, True, False)

        async def unpin():
            served.store.release("reader")

        served.call(unpin())
        connector.publish([(2, b"\x02" * fp.block_bytes)])  # what build_connector_meta now offers again
        connector.flush()

        async def stored():
            return served.store.lookup(fp.namespace, [2])

        assert (served.call(stored()), connector.is_known(2)) == (1, True)
    finally:
        connector.close()
        served.stop()


def test_cancelled_fetch_releases_leases_and_never_reports():
    DelayingServicer.get_delay_s = STALL_S  # the transfer stalls after its first message until cancelled
    served = ServedKVStore(KVStore(memory_bytes=1 << 20), servicer_cls=DelayingServicer)
    conn = KVStoreConnector(served.address, FP, fetch_timeout_s=STALL_S)  # no deadline ends it either
    try:
        conn.publish([(h, payload(torch.ones(SHAPE))) for h in range(1, 21)])
        conn.flush()
        conn.start_fetch("req-2", 0, list(range(1, 21)))
        wait_until(lambda: served.stats().num_leases == 20)
        conn.cancel("req-2")
        wait_until(lambda: served.stats().num_leases == 0)
        wait_until(lambda: fetch_tasks(conn) == [])  # the fetch ended: nothing is left that could report
        assert conn.poll() == [] and conn.stats().fetches == 0
    finally:
        DelayingServicer.get_delay_s = 0.0
        conn.close()
        served.stop()


def test_store_down_means_an_empty_result():
    served = ServedKVStore(KVStore(memory_bytes=1 << 20))
    address = served.address
    served.stop()
    conn = KVStoreConnector(address, FP)
    try:
        conn.start_fetch("req-3", 0, [1, 2])
        [result] = poll_until(conn)
        assert result.payloads == [] and conn.stats().fetch_failures == 1
    finally:
        conn.close()


def test_a_fetch_cancelled_after_it_finished_never_reports():
    served = ServedKVStore(KVStore(memory_bytes=1 << 20))
    conn = KVStoreConnector(served.address, FP)
    fetched = []
    conn.set_waker(lambda: fetched.append(1))
    try:
        conn.publish([(h, payload(torch.ones(SHAPE))) for h in (1, 2)])
        conn.flush()
        conn.start_fetch("req-3", 0, [1, 2])
        wait_until(lambda: fetched == [1])      # finished, its result not polled yet
        conn.cancel("req-3")
        conn.start_fetch("req-3", 1, [2])       # the same id again (a retry)
        wait_until(lambda: fetched == [1, 1])
        [result] = conn.poll()
        assert (result.request_id, result.start_block, result.num_requested, len(result.payloads)) == ("req-3", 1, 1, 1)
        assert conn.poll() == [] and conn._fetches == {}
    finally:
        conn.close()
        served.stop()
