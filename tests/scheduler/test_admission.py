"""AdmissionCore without gRPC: exact assignment order, block accounting, errors."""

import pytest

from meshserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.registry import ExecutorState


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def executor(eid, num_blocks=10, block_size=16, max_model_len=1024, model="m"):
    return ExecutorState(eid, f"addr-{eid}", model, num_blocks, block_size, max_model_len)


def req(rid, tokens=15, model="m"):
    return AdmissionRequest(rid, "t", 0, tokens, 16, model)


def test_no_executor_is_unavailable():
    core = AdmissionCore()
    with pytest.raises(Unavailable, match="no executor"):
        core.submit(req("a"))
    core.registry.add(executor("e0", model="other"))
    with pytest.raises(Unavailable, match="'m'"):
        core.submit(req("a"))


def test_request_that_never_fits_is_invalid():
    core = AdmissionCore()
    core.registry.add(executor("e0", num_blocks=4, block_size=16, max_model_len=1024))
    with pytest.raises(InvalidArgument, match="63 prompt tokens"):
        core.submit(req("a", tokens=64))  # needs 5 blocks (64 + 1 tokens), the cache has 4
    core.submit(req("b", tokens=63))
    assert core.queued()[0].request_id == "b"


def test_fcfs_to_most_free_executor_with_pending_blocks():
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(pending_timeout_s=5.0), clock=clock)
    core.registry.add(executor("e0", num_blocks=10))
    core.registry.add(executor("e1", num_blocks=8))
    for rid in ("a", "b", "c"):
        core.submit(req(rid, tokens=47))  # 3 blocks each
    got = [(r.request_id, lease.executor_id, lease.num_blocks) for r, lease in core.dispatch()]
    # a -> e0 (10 free), b -> e1 (8 vs 7), c -> e0 (7 vs 5)
    assert got == [("a", "e0", 3), ("b", "e1", 3), ("c", "e0", 3)]
    assert core.registry.get("e0").available_blocks(clock(), 5.0) == 4
    assert core.registry.get("e1").available_blocks(clock(), 5.0) == 5


def test_head_of_line_waits_and_release_unblocks():
    core = AdmissionCore()
    core.registry.add(executor("e0", num_blocks=4))
    core.submit(req("big", tokens=63))  # 4 blocks
    core.submit(req("small", tokens=1))
    (r, lease), = core.dispatch()
    assert r.request_id == "big"
    assert core.dispatch() == []  # small waits: nothing free
    assert core.position("small") == 0
    core.registry.report("e0", 0, 1, 0, {lease.lease_id})
    assert core.dispatch() == []
    assert core.release(lease.lease_id) is True
    assert core.release(lease.lease_id) is False  # idempotent
    core.registry.report("e0", 4, 0, 0, set())
    assert [r.request_id for r, _ in core.dispatch()] == ["small"]
    assert len(core) == 0


def test_a_head_request_without_room_holds_back_smaller_requests_of_its_model():
    core = AdmissionCore()
    core.registry.add(executor("e0", num_blocks=8))
    core.registry.report("e0", 2, 1, 0, set())  # 2 blocks free
    core.submit(req("big", tokens=63))  # needs 4 blocks
    core.submit(req("small", tokens=1))  # needs 1: it would fit, but waits behind big
    assert core.dispatch() == []
    assert [r.request_id for r in core.queued()] == ["big", "small"]
    core.registry.report("e0", 5, 0, 0, set())
    assert [(r.request_id, lease.num_blocks) for r, lease in core.dispatch()] == [("big", 4), ("small", 1)]


def test_a_head_request_without_room_does_not_hold_back_another_models_requests():
    core = AdmissionCore()
    core.registry.add(executor("ex-a", num_blocks=10, model="A"))
    core.registry.add(executor("ex-b", num_blocks=1000, model="B"))
    core.submit(req("a1", tokens=100, model="A"))  # 7 blocks
    assert [r.request_id for r, _ in core.dispatch()] == ["a1"]
    core.submit(req("a2", tokens=100, model="A"))  # ex-a has 3 blocks left: waits
    core.submit(req("a3", tokens=1, model="A"))  # 1 block would fit: waits behind a2
    core.submit(req("b1", tokens=100, model="B"))
    assert [(r.request_id, lease.executor_id) for r, lease in core.dispatch()] == [("b1", "ex-b")]
    assert [r.request_id for r in core.queued()] == ["a2", "a3"]


def test_acknowledged_lease_is_not_counted_twice_and_pending_expires():
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(pending_timeout_s=5.0), clock=clock)
    core.registry.add(executor("e0", num_blocks=10))
    core.submit(req("a", tokens=47))
    (_, lease), = core.dispatch()
    e0 = core.registry.get("e0")
    assert e0.available_blocks(clock(), 5.0) == 7
    core.registry.report("e0", 7, 1, 0, {lease.lease_id})  # the executor now holds it
    assert e0.available_blocks(clock(), 5.0) == 7
    core.submit(req("b", tokens=47))
    core.dispatch()
    clock.t += 6.0  # b's gateway never called Execute: its promise lapses
    assert e0.available_blocks(clock(), 5.0) == 7


def test_queue_bound_and_cancel():
    core = AdmissionCore(SchedulerConfig(max_queue_len=2))
    core.registry.add(executor("e0", num_blocks=1))
    core.submit(req("a", tokens=15))
    core.submit(req("b", tokens=15))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        core.submit(req("c"))
    assert core.cancel("a") is True
    assert core.position("b") == 0
    assert core.cancel("a") is False


def test_removed_executor_detaches_its_leases_until_their_gateway_releases_them():
    core = AdmissionCore()
    core.registry.add(executor("e0"))
    core.submit(req("a"))
    (_, lease), = core.dispatch()
    assert core.num_leases() == 1
    assert [x.lease_id for x in core.remove_executor("e0")] == [lease.lease_id]
    assert (core.num_leases(), core.lease(lease.lease_id).listed) == (1, False)
    assert core.release(lease.lease_id) is True
    assert (core.num_leases(), core.release(lease.lease_id)) == (0, False)


def test_n_choices_count_n_times_the_blocks_capped_at_the_cache():
    core = AdmissionCore()
    core.registry.add(executor("e0", num_blocks=10))
    core.submit(AdmissionRequest("a", "t", 0, 31, 16, "m", n=3))  # 2 blocks per choice
    core.submit(AdmissionRequest("b", "t", 0, 31, 16, "m", n=4))  # 8 > the 4 left: waits
    assert [(r.request_id, lease.num_blocks) for r, lease in core.dispatch()] == [("a", 6)]
    core.release(next(iter(core.registry.get("e0").leases)))
    assert [(r.request_id, lease.num_blocks) for r, lease in core.dispatch()] == [("b", 8)]
    core.submit(AdmissionRequest("c", "t", 0, 31, 16, "m", n=16))  # 32 blocks: capped at the 10 of the cache
    core.release(next(iter(core.registry.get("e0").leases)))
    assert [(r.request_id, lease.num_blocks) for r, lease in core.dispatch()] == [("c", 10)]


def test_predicted_kv_reservation_keeps_room_for_output_growth():
    """``kv_reservation="predicted"``: room counts the request's predicted output blocks and the
    predicted growth of the executor's leases; ``prompt`` counts prompt blocks only."""
    def setup(mode, rids):
        core = AdmissionCore(SchedulerConfig(kv_reservation=mode, predictor_min_samples=1), clock=Clock())
        core.registry.add(executor("e0", num_blocks=10))
        core.predictor.observe("t", 15, 16)  # learned: 16 output tokens (tenant "t", 15-token prompts)
        for rid in rids:
            core.submit(req(rid, tokens=15))  # prompt: 1 block; prompt + 16 output + 1: 2 blocks
        return core
    rids = ["a", "b", "c", "d", "e", "f"]
    assert [r.request_id for r, _ in setup("prompt", rids).dispatch()] == rids  # 6 × 1 prompt block
    core = setup("predicted", rids)
    got = [(r.request_id, lease.num_blocks) for r, lease in core.dispatch()]
    assert got == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)]  # 5 × 2 predicted = 10; f waits
    e0 = core.registry.get("e0")
    core.on_capacity("e0", 5, 5, 0, list(e0.leases))  # acked, 1 block each: growth 5 × 1 = the 5 free
    assert core.dispatch() == []
    lease_a = next(lease for lease in e0.leases.values() if lease.request_id == "a")
    core.release(lease_a.lease_id, 16)
    core.on_capacity("e0", 6, 4, 0, list(e0.leases))
    assert [r.request_id for r, _ in core.dispatch()] == ["f"]


def test_prior_predictions_are_asked_again_once_the_predictor_learns():
    core = AdmissionCore(SchedulerConfig(queue_policy="sjf", predictor_min_samples=1))
    core.registry.add(executor("e0", num_blocks=4))
    core.on_capacity("e0", 0, 1, 0, [])  # full: nothing is placed
    core.submit(req("a", tokens=15))
    queued = core.queued()[0]
    assert (queued.predicted_output_tokens, queued.prediction_level, queued.cost) == (8, "prior", 23)
    core.predictor.observe("t", 15, 3)
    assert core.dispatch() == []
    queued = core.queued()[0]
    assert (queued.predicted_output_tokens, queued.prediction_level, queued.cost) == (3, "tenant+bucket", 18)


def test_a_proposed_lease_id_names_the_lease_and_is_unique_while_queued_or_leased():
    from meshserve.errors import AlreadyExists

    core = AdmissionCore()
    core.registry.add(executor("e0", num_blocks=1))
    lease_a, lease_b = "a" * 32, "b" * 32
    first = AdmissionRequest("a", "t", 0, 15, 0, "m", lease_id=lease_a)
    core.submit(first)
    [(_, lease)] = core.dispatch()
    assert lease.lease_id == lease_a
    core.submit(AdmissionRequest("b", "t", 0, 15, 0, "m", lease_id=lease_b))  # queued: the one block is leased
    assert core.dispatch() == []
    for taken in (lease_a, lease_b):
        with pytest.raises(AlreadyExists, match=f"lease_id '{taken}' is already in use"):
            core.submit(AdmissionRequest("c", "t", 0, 15, 0, "m", lease_id=taken))
    assert [r.request_id for r in core.queued()] == ["b"]
    assert core.release(lease_a)
    [(_, second)] = core.dispatch()
    assert second.lease_id == lease_b and not core.lease_id_in_use(lease_a)



def test_a_lease_id_its_executor_still_lists_is_not_granted_again():
    """A released lease id proposed again while its executor still runs and lists the
    old request (its Execute not ended yet) would be renewed by the old run's listing
    and charged the old run's blocks: it is refused as in use until no report lists it."""
    from meshserve.errors import AlreadyExists

    core = AdmissionCore(SchedulerConfig(lease_ttl_s=10))
    core.registry.add(executor("e0", num_blocks=10))
    reused = "c" * 32
    core.submit(AdmissionRequest("old", "t", 0, 15, 0, "m", lease_id=reused))
    core.dispatch()
    core.on_capacity("e0", 9, 1, 0, [reused], {reused: 1})  # running there
    assert core.release(reused)  # the gateway released it; the executor still runs "old" under it
    with pytest.raises(AlreadyExists):
        core.submit(AdmissionRequest("new", "t", 0, 15, 0, "m", lease_id=reused))
    core.on_capacity("e0", 10, 0, 0, [], {})  # the old run ended there
    core.submit(AdmissionRequest("new", "t", 0, 15, 0, "m", lease_id=reused))
    [(_, new)] = core.dispatch()
    assert new.lease_id == reused and core.quotas.snapshot() == {"t": 1}
