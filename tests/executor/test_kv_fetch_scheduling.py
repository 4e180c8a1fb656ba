"""The scheduler half of kvstore transfer driving the batch scheduler, without a
model, over a real kvstore service: a request waits in WAITING_FOR_REMOTE_KVS,
fetched blocks extend its local prefix hit into newly allocated blocks (exact ids
in ``kv_loads``), the blocks a step completes are listed once in ``kv_saves`` and
published, a capped or gapped fetch loads nothing more, a fetch past its deadline
(a fake clock) is given up and recomputed, a late completion is ignored, an
abort while fetching holds nothing, and a retry under an aborted request's id never
loads that request's fetched blocks."""

from __future__ import annotations

import threading
import time

import pytest

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.kv_connector import FetchResult, KVConnectorScheduler, usable_payloads
from executor.engine.request import Request, RequestStatus
from executor.engine.scheduler_output import BlockSave, ModelRunnerOutput
from executor.kvstore_connector import KVStoreConnector
from kvstore.store import KVStore
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_full_blocks
from meshserve.sampling import SamplingParams
from tests.support.engine_steps import make_request, shares
from tests.support.served_kvstore import DelayingServicer, ServedKVStore

BS = 4
FP = KVStoreFingerprint(ModelFingerprint("m", "r"), KVLayout(BS, 1, 1, 2, "float32"))  # 32-byte blocks


def payload(i: int) -> bytes:
    return bytes([i]) * FP.block_bytes


def chain(request: Request) -> list[int]:
    return hash_full_blocks(request.all_token_ids, BS, FP.model.root_hash)


class Mesh:
    """A batch scheduler with a connector's scheduler half over a served store, a
    second connector playing another executor that publishes blocks, and a fake clock."""

    def __init__(self, servicer_cls=None, budget: int = 64, fetch_timeout_s: float = 60.0, **config):
        kwargs = {"servicer_cls": servicer_cls} if servicer_cls else {}
        self.served = ServedKVStore(KVStore(memory_bytes=1 << 20), **kwargs)
        self.connector = KVStoreConnector(self.served.address, FP, fetch_timeout_s=fetch_timeout_s)
        self.other = KVStoreConnector(self.served.address, FP)
        self.fetched = threading.Event()
        self.connector.set_waker(self.fetched.set)
        kv = KVCacheManager(32, BS, enable_caching=True, fingerprint=FP.model)
        config.setdefault("max_num_seqs", 4)
        self.s = BatchScheduler(BatchSchedulerConfig(max_num_batched_tokens=budget, **config), kv)
        self.half = KVConnectorScheduler(self.connector, kv)
        self.s.set_kv_connector(self.half)
        self.now = [0.0]
        self.s.clock = lambda: self.now[0]

    def publish_elsewhere(self, request: Request, num_blocks: int) -> None:
        """Another executor stored the request's first blocks, payload ``i`` for block ``i``."""
        self.other.publish([(h, payload(i)) for i, h in enumerate(chain(request)[:num_blocks])])
        self.other.flush()

    def wait_fetched(self) -> None:
        assert self.fetched.wait(60), "the fetch did not finish"
        self.fetched.clear()

    def step(self, token: int = 7):
        """schedule() and update_from_output() with ``token`` sampled and each saved
        block's payload ``100 + block_id``; checks the KV invariants."""
        out = self.s.schedule()
        runner = ModelRunnerOutput({r.request_id: token for r in out.scheduled if r.sample},
                                   kv_saved=[payload(100 + save.block_id) for save in out.kv_saves])
        results = self.s.update_from_output(out, runner)
        self.s.kv.check_integrity()
        return out, results

    def stored_blocks(self, hashes: list[int]) -> int:
        """Leading ``hashes`` the store holds (read on its own loop)."""
        async def lookup():
            return self.served.store.lookup(FP.namespace, hashes)
        return self.served.call(lookup())

    def close(self) -> None:
        self.connector.close()
        self.other.close()
        self.served.stop()


def test_fetched_blocks_skip_prefill_are_loaded_into_new_blocks_and_completed_ones_published():
    m = Mesh()
    try:
        r = make_request("r", 18)               # 4 full blocks + 2 tokens; at most 4 blocks of hits
        m.publish_elsewhere(r, 3)
        m.s.add_request(r)
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and m.s.kvstore_queried_tokens == 16
        m.wait_fetched()
        out, results = m.step()
        assert shares(out) == {"r": 6} and out.scheduled[0].num_computed_tokens == 12
        assert out.kv_loads == [(0, payload(0)), (1, payload(1)), (2, payload(2))]
        assert m.s.kv.get_block_ids("r") == [0, 1, 2, 3, 4]
        assert (r.num_cached_tokens, r.num_kvstore_tokens, m.s.kvstore_hit_tokens) == (12, 12, 12)
        assert results[0].num_kvstore_tokens == 12 and results[0].num_cached_tokens == 12
        # the step completes block 3 (tokens 12..15): saved once, then published by the half
        assert out.kv_saves == [BlockSave(3, chain(r)[3], "r")]
        # every full block got registered, loaded ones included (they hold valid K/V now)
        assert [m.s.kv.block_pool.get_cached_block(h).block_id for h in chain(r)] == [0, 1, 2, 3]
        assert m.s.prefix_cache_hit_tokens == 0   # local hits only
        m.connector.flush()
        assert m.stored_blocks(chain(r)) == 4 and m.connector.stats().published_blocks == 1
        out, _ = m.step()                       # a decode completes no block: nothing to save
        assert out.kv_saves == [] and out.kv_loads == []
    finally:
        m.close()


def test_fetched_blocks_continue_a_local_hit_and_are_capped():
    m = Mesh(budget=9)
    try:
        r = make_request("r", 12)               # 3 full blocks; at most 2 blocks of hits (keep the last token)
        m.publish_elsewhere(r, 2)
        m.s.add_request(r)                      # fetches blocks 0, 1
        m.wait_fetched()
        # a computes every prompt position (prompt logprobs: it never fetches) and goes first
        m.s.add_request(make_request("a", 9, priority=1, prompt_logprobs=0))
        out, _ = m.step()
        assert shares(out) == {"a": 9}          # the whole budget: a caches blocks 0, 1 here meanwhile
        m.s.abort_request("a")
        out, _ = m.step()
        assert out.kv_loads == [] and shares(out) == {"r": 4}  # 2 local blocks, the cap leaves nothing to load
        assert (r.num_cached_tokens, r.num_kvstore_tokens) == (8, 0)
    finally:
        m.close()

    m = Mesh(budget=13)
    try:
        h = make_request("h", 24)               # at most 5 blocks of hits
        m.publish_elsewhere(h, 5)
        m.s.add_request(h)                      # fetches blocks 0 .. 4
        m.wait_fetched()
        m.s.add_request(make_request("a", 13, priority=1, prompt_logprobs=0))  # caches blocks 0-2 here first
        out, _ = m.step()
        assert shares(out) == {"a": 13}
        out, _ = m.step()                       # the fetched run overlaps the local hit by three blocks
        assert [p for _, p in out.kv_loads] == [payload(3), payload(4)] and out.scheduled[-1].num_computed_tokens == 20
        assert (h.num_cached_tokens, h.num_kvstore_tokens) == (20, 8)
        assert [b for b, _ in out.kv_loads] == m.s.kv.get_block_ids("h")[3:5]
        m.s.kv.check_integrity()
    finally:
        m.close()


def test_usable_payloads_continue_the_local_hit_without_gaps():
    p = [b"p2", b"p3", b"p4"]                   # fetched from block 2
    assert usable_payloads(2, p, 3, 5) == [b"p3", b"p4"]   # overlaps the local hit by one block
    assert usable_payloads(2, p, 3, 4) == [b"p3"]          # capped below the last token
    assert usable_payloads(2, p, 1, 5) == []               # a gap: block 1 is neither cached nor fetched
    assert usable_payloads(2, p, 5, 5) == []               # the local hit already reaches the cap
    assert usable_payloads(0, [b"p0", b"p1"], 0, 1) == [b"p0"]


def wait_no_leases(m: Mesh) -> None:
    deadline = time.monotonic() + 60
    while m.served.stats().num_leases:
        assert time.monotonic() < deadline, "leases still held"
        time.sleep(0.01)


def test_expired_fetches_late_completions_and_aborts():
    DelayingServicer.get_delay_s = 3600.0       # a Get never finishes: only its deadline (the fake clock) ends it
    # the same timeout bounds the Get's gRPC call on the real clock: 600 s, past any stall of the host
    m = Mesh(servicer_cls=DelayingServicer, fetch_timeout_s=600.0)
    try:
        r = make_request("r", 10)
        m.publish_elsewhere(r, 2)
        m.s.add_request(r)
        assert m.s.wake_deadline() == 600.0
        m.now[0] = 599.9
        out, results = m.step()
        assert out.is_empty and results == [] and m.s.has_unfinished_requests()
        m.now[0] = 600.0
        out, _ = m.step()                       # given up: recomputes
        assert shares(out) == {"r": 10} and out.kv_loads == [] and m.s.wake_deadline() is None
        assert m.connector.stats().fetch_failures == 1
        assert not m.half.on_fetch_result(FetchResult("r", 0, [payload(0)], 2))  # a late completion is ignored
        wait_no_leases(m)                       # the cancelled Get released its leases
        q = Request("q", list(range(50, 60)), SamplingParams(max_tokens=4), 0, 99, 10_000)  # not cached here
        m.s.add_request(q)
        assert q.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert m.s.abort_request("q") and "q" not in m.s.fetching and q.status == RequestStatus.FINISHED_ABORTED
        assert not m.half.on_fetch_result(FetchResult("q", 0, [payload(0)], 2))
        wait_no_leases(m)
        while m.s.has_unfinished_requests():
            m.step()
        assert m.s.kv.num_free_blocks == m.s.kv.num_blocks
        assert m.connector.poll() == [] and m.connector._fetches == {}
    finally:
        DelayingServicer.get_delay_s = 0.0
        m.close()


def test_dropping_the_connector_while_fetching_recomputes():
    DelayingServicer.get_delay_s = 3600.0
    m = Mesh(servicer_cls=DelayingServicer)
    try:
        r = make_request("r", 10)
        m.publish_elsewhere(r, 2)
        m.s.add_request(r)
        m.s.set_kv_connector(None)              # the fetch is cancelled; r waits to recompute
        assert r.status == RequestStatus.WAITING and m.s.fetching == {}
        out, _ = m.step()
        assert shares(out) == {"r": 10} and out.kv_loads == [] and out.kv_saves == []
        wait_no_leases(m)
    finally:
        DelayingServicer.get_delay_s = 0.0
        m.close()


@pytest.mark.parametrize("prompt_logprobs", [None, 0])
def test_nothing_to_fetch_queues_the_request_at_once(prompt_logprobs):
    m = Mesh()
    try:
        a = make_request("a", 9)
        m.s.add_request(a)                      # the store is empty but the half cannot know: it asks
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        m.wait_fetched()
        m.step()
        assert m.s.kvstore_queried_tokens == 8 and m.s.kvstore_hit_tokens == 0
        # b's prompt is cached here up to its last block: nothing left to fetch; prompt
        # logprobs need every position computed: never fetched
        b = make_request("b", 9, prompt_logprobs=prompt_logprobs)
        m.s.add_request(b)
        assert b.status == RequestStatus.WAITING and m.s.kvstore_queried_tokens == 8
    finally:
        m.close()


def test_a_retry_under_the_same_id_never_loads_the_aborted_requests_fetch():
    m = Mesh()
    try:
        old = make_request("r", 18)
        m.publish_elsewhere(old, 3)
        m.s.add_request(old)
        m.wait_fetched()                        # its result waits in the connector, not polled yet
        assert m.s.abort_request("r")
        new = Request("r", list(range(50, 68)), SamplingParams(max_tokens=4), 0, 99, 10_000)  # nothing stored
        m.s.add_request(new)
        assert new.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        m.wait_fetched()
        out, _ = m.step()
        assert shares(out) == {"r": 18} and out.kv_loads == []
        assert (new.num_cached_tokens, new.num_kvstore_tokens, m.s.kvstore_hit_tokens) == (0, 0, 0)
        assert m.connector.poll() == [] and m.connector._fetches == {}
    finally:
        m.close()


def test_a_higher_priority_request_waiting_on_a_shared_block_preempts_nobody_for_it():
    """L (low priority, 3 blocks fetched from another executor) and W (high priority,
    sharing the prefix A is computing) wait while A runs; ``max_num_seqs`` is 2. W waits
    for A's blocks before it would take a slot, so L is admitted with its loads and keeps
    them. (Before, W preempted L, admitted with its loads in that step, then waited
    anyway: L recomputed everything, and its loads had to be discarded.)"""
    m = Mesh(budget=32, max_num_seqs=2, long_prefill_token_threshold=8)
    try:
        shared = list(range(40))
        a = Request("A", shared, SamplingParams(max_tokens=4, ignore_eos=True), 0, 0, 10_000)
        m.s.add_request(a)
        m.wait_fetched()                        # nothing stored: A computes the shared prefix
        m.step()
        low = Request("L", [50 + i for i in range(13)], SamplingParams(max_tokens=4, ignore_eos=True), 0, 2, 10_000)
        m.publish_elsewhere(low, 3)
        high = Request("W", shared + [99] * 3, SamplingParams(max_tokens=4, ignore_eos=True), 1, 1, 10_000)
        m.s.add_request(high)
        m.wait_fetched()
        m.s.add_request(low)
        m.wait_fetched()
        out, _ = m.step()
        assert (shares(out), out.preempted_request_ids, m.s.num_deferred_for_prefix) == ({"A": 8, "L": 1}, [], 1)
        assert [(block, bytes(p)) for block, p in out.kv_loads] == [(10 + i, payload(i)) for i in range(3)]
        assert (low.num_cached_tokens, low.num_kvstore_tokens, m.s.kvstore_hit_tokens) == (12, 12, 12)
        finals = {}
        for _ in range(40):
            _, results = m.step()
            finals.update({r.request_id: r for r in results if r.finished})
        assert {rid: (r.num_cached_tokens, r.num_kvstore_tokens) for rid, r in finals.items()} == {
            "A": (0, 0), "L": (12, 12), "W": (40, 0)}  # W read A's 10 blocks from the local cache
        assert m.s.kv.block_pool.num_free_blocks == 32  # every block back
    finally:
        m.close()


@pytest.mark.parametrize("order", ["shortest", "arrival"])
def test_shortest_first_counts_the_blocks_the_kvstore_can_load(order):
    """A request with 60 of its 61 tokens loadable from the kvstore has one token to compute:
    shortest first takes it before a new 24-token prompt (found by breaking it: sorted as 61
    tokens, it waited while the new prompt took the whole budget)."""
    m = Mesh(budget=24, prefill_order=order, short_prefill_tokens=0)
    try:
        stored = make_request("stored", 61, max_tokens=1)
        m.publish_elsewhere(stored, 15)
        fresh = make_request("fresh", 24, max_tokens=1)  # arrives after stored, shares no block with it
        fresh.prompt_token_ids[:] = fresh.all_token_ids[:] = [500 + i for i in range(24)]
        m.s.add_request(stored)
        m.wait_fetched()
        m.s.add_request(fresh)  # asks the store too, which has nothing of it
        m.wait_fetched()
        out, results = m.step()
        assert shares(out) == {"stored": 1, "fresh": 23}
        assert [r.request_id for r in results] == ["stored"] and stored.num_kvstore_tokens == 60
    finally:
        m.close()
