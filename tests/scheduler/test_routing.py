"""Prefix index and the routing cost function: exact costs and exact choices."""

import pytest

from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.prefix_index import PrefixIndex
from scheduler.registry import ExecutorState
from scheduler.routing import Candidate, RoutingConfig, Scored, route, score

H = [bytes([i]) * 16 for i in range(8)]  # a chain of 8 block hashes


def test_prefix_index_counts_leading_blocks_only_and_forgets_executors():
    index = PrefixIndex()
    index.stored("e0", H[:4])
    index.stored("e1", H[:2] + H[3:4])       # holds blocks 0, 1 and 3, not 2
    index.stored("e2", H[1:3])               # lacks block 0: no leading hit
    assert index.hit_blocks(H) == {"e0": 4, "e1": 2}
    index.removed("e0", [H[1], b"unknown"])
    assert index.hit_blocks(H) == {"e0": 1, "e1": 2}
    index.drop("e1")
    assert index.hit_blocks(H) == {"e0": 1}
    assert (index.num_blocks("e0"), index.num_blocks("e1"), index.num_blocks("e2")) == (3, 0, 2)
    index.check_integrity()
    assert index.hit_blocks([]) == {}


def test_cost_is_uncached_prefill_plus_load():
    cands = [Candidate("e0", hit_tokens=512, load_tokens=1000, available_blocks=10),
             Candidate("e1", hit_tokens=0, load_tokens=600, available_blocks=20)]
    # e0: (600 - 512) + 1000 = 1088; e1: 600 + 600 = 1200
    assert score(cands, 600, RoutingConfig()) == [Scored("e0", 1088.0, 512, False), Scored("e1", 1200.0, 0, False)]
    # least-loaded ignores the hit: e0 600 + 1000, e1 1200
    assert route(cands, 600, RoutingConfig(policy="least-loaded")) == Scored("e1", 1200.0, 0, False)
    # weights: load counts double → e0 88 + 2000 = 2088, e1 600 + 1200 = 1800
    assert route(cands, 600, RoutingConfig(load_weight=2.0)).executor_id == "e1"


def test_full_hit_still_costs_the_last_prompt_token():
    (s,) = score([Candidate("e0", 64, 0, 1)], 64, RoutingConfig())
    assert s == Scored("e0", 1.0, 63, False)


def test_overloaded_executor_loses_its_prefix_bonus():
    # mean load = (4000 + 3 * 500) / 4 = 1375; e0: 4000 > 1.5 * 1375 and 4000 - 1375 = 2625 > 2048
    cands = [Candidate("e0", 4000, 4000, 5)] + [Candidate(f"e{i}", 0, 500, 5) for i in (1, 2, 3)]
    scored = score(cands, 4100, RoutingConfig())
    assert scored[0] == Scored("e1", 4600.0, 0, False)
    assert scored[-1] == Scored("e0", 8100.0, 0, True)
    # with the absolute threshold out of reach the bonus stands: e0 costs 100 + 4000 < 4600
    assert route(cands, 4100, RoutingConfig(balance_abs_tokens=3000)) == Scored("e0", 4100.0, 4000, False)
    # at exactly 1.5 x the mean it is not overloaded: mean (3000 + 1000) / 2 = 2000
    close = [Candidate("e0", 4000, 3000, 5), Candidate("e1", 0, 1000, 5)]
    assert route(close, 4100, RoutingConfig(balance_abs_tokens=0)) == Scored("e0", 3100.0, 4000, False)


def test_ties_prefer_more_available_blocks_then_id():
    cands = [Candidate("b", 0, 0, 5), Candidate("a", 0, 0, 5), Candidate("c", 0, 0, 9)]
    assert [s.executor_id for s in score(cands, 10, RoutingConfig())] == ["c", "a", "b"]
    assert route([], 10, RoutingConfig()) is None


def test_bad_routing_config():
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="balance_factor"):
        RoutingConfig(balance_factor=0.5)
    with pytest.raises(ValueError, match="weights"):
        RoutingConfig(load_weight=-1)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def core_with(n=3, num_blocks=64, block_size=16):
    core = AdmissionCore(SchedulerConfig(), clock=Clock())
    for i in range(n):
        core.registry.add(ExecutorState(f"e{i}", f"a{i}", "m", num_blocks, block_size, 4096))
    return core


def req(rid, tokens, hashes=(), hash_block_size=16):
    return AdmissionRequest(rid, "t", 0, tokens, 16, "m", block_hashes=tuple(hashes), hash_block_size=hash_block_size)


def test_admission_routes_to_the_executor_holding_the_prefix():
    core = core_with()
    core.on_kv_events("e2", stored=H[:4], removed=[])   # e2 caches 4 blocks = 64 tokens of the prompt
    core.on_kv_events("e1", stored=H[:1], removed=[])
    core.submit(req("r", 100, H[:6]))                   # 100 tokens: 6 full blocks, 7 blocks with + 1
    ((_, lease),) = core.dispatch()
    # costs: e0 100, e1 100 - 16 = 84, e2 100 - 64 = 36 (all loads 0)
    assert (lease.executor_id, lease.num_hit_tokens, lease.num_blocks) == ("e2", 64, 7)
    # e2's load is now that lease's outstanding work: 100 prompt + 8 predicted (prior: max_tokens 16 // 2)
    # - 64 hit = 44 → r2 on e2 costs 36 + 44 = 80 < e1's 84: e2 again; r3 then costs 36 + 88 = 124 > 84: e1
    core.submit(req("r2", 100, H[:6]))
    core.submit(req("r3", 100, H[:6]))
    assert [(lease.executor_id, lease.num_hit_tokens) for _, lease in core.dispatch()] == [("e2", 64), ("e1", 16)]
    # the executor reports r's requests hold 7 blocks (112 tokens >= 108): r's work no longer counts
    core.on_capacity("e2", 50, 2, 0, [lease.lease_id], {lease.lease_id: 7})
    core.submit(req("r4", 100, H[:6]))  # e2: 36 + 44 (r2) = 80; e0: 100; e1: 84 + 92 (r3) = 176
    assert [(lease.executor_id, lease.num_hit_tokens) for _, lease in core.dispatch()] == [("e2", 64)]


def test_hits_count_only_for_the_block_size_they_were_hashed_with():
    core = core_with(n=2)
    core.registry.add(ExecutorState("e8", "a8", "m", 128, 8, 4096))  # block size 8
    core.on_kv_events("e8", stored=H[:4], removed=[])
    core.submit(req("r", 100, H[:6], hash_block_size=16))
    ((_, lease),) = core.dispatch()
    assert (lease.executor_id, lease.num_hit_tokens) == ("e8", 0)  # no credit; e8 wins on free blocks (128)
    core.on_kv_events("e0", stored=H[:2], removed=[])
    core.submit(req("r2", 100, H[:6], hash_block_size=16))
    ((_, lease),) = core.dispatch()
    assert (lease.executor_id, lease.num_hit_tokens) == ("e0", 32)


def test_disconnected_executor_leaves_the_index_and_events_of_unknown_executors_are_ignored():
    core = core_with(n=2)
    core.on_kv_events("e1", stored=H[:3], removed=[])
    core.on_kv_events("ghost", stored=H[:3], removed=[])
    assert core.prefix_index.hit_blocks(H) == {"e1": 3}
    core.remove_executor("e1")
    assert core.prefix_index.hit_blocks(H) == {}
    core.on_kv_events("e0", stored=H[:2], removed=[])
    core.on_kv_events("e0", stored=H[4:5], removed=[], reset=True)  # a snapshot replaces what it held
    assert core.prefix_index.num_blocks("e0") == 1 and core.prefix_index.hit_blocks(H) == {}
