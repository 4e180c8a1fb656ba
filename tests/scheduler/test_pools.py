"""Instance pools: priority classes → pools, spill only from a saturated pool into an idle one."""

import pytest

from meshserve.errors import Unavailable
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.pools import PoolsConfig, PoolSpec, candidate_executors
from scheduler.registry import ExecutorState

POOLS = PoolsConfig.from_dict({
    "default_pool": "batch",
    "pools": {
        "interactive": {"priorities": [1, 2], "spill_to": ["batch"]},
        "batch": {"priorities": [0], "spill_to": ["interactive"], "idle_free_fraction": 0.5},
    },
})


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def ex(eid, pool, num_blocks=8):
    return ExecutorState(eid, f"addr-{eid}", "m", num_blocks, 16, 4096, pool=pool)


def core_with(*executors):
    core = AdmissionCore(SchedulerConfig(pools=POOLS), clock=Clock())
    for e in executors:
        core.registry.add(e)
    return core


def req(rid, priority, tokens=15):
    return AdmissionRequest(rid, "t", priority, tokens, 16, "m")  # 15 tokens: 1 block


def placed(core):
    return [(r.request_id, lease.executor_id) for r, lease in core.dispatch()]


def test_config_maps_priority_classes_and_validates():
    assert [POOLS.pool_of(p) for p in (0, 1, 2, 3, -1)] == ["batch", "interactive", "interactive", "batch", "batch"]
    assert POOLS.spec("interactive") == PoolSpec("interactive", (1, 2), ("batch",), 0.5)
    with pytest.raises(ValueError, match="priority class 1 is in pools 'a' and 'b'"):
        PoolsConfig.from_dict({"pools": {"a": {"priorities": [1]}, "b": {"priorities": [1]}}})
    with pytest.raises(ValueError, match="spill_to names 'nope'"):
        PoolsConfig.from_dict({"pools": {"a": {"spill_to": ["nope"]}}})
    with pytest.raises(ValueError, match="idle_free_fraction"):
        PoolsConfig.from_dict({"pools": {"a": {"idle_free_fraction": 1.5}}})
    with pytest.raises(ValueError, match="unknown keys"):
        PoolsConfig.from_dict({"pool": {}})


@pytest.mark.parametrize("body, message", [
    ({"priorities": 1}, "pool 'a': priorities must be a list of integers, e.g. [1, 2], got 1"),
    ({"priorities": [1, "2"]}, "pool 'a': priorities must be a list of integers, e.g. [1, 2], got [1, '2']"),
    ({"spill_to": "b"}, "pool 'a': spill_to must be a list of pool names, e.g. [\"batch\"], got 'b'"),
    ({"idle_free_fraction": [0.5]}, "pool 'a': idle_free_fraction must be a number in [0, 1], got [0.5]"),
])
def test_pools_file_of_the_wrong_types_is_a_value_error_that_says_what_is_expected(body, message):
    with pytest.raises(ValueError) as err:
        PoolsConfig.from_dict({"pools": {"a": body, "b": {}}})
    assert str(err.value) == message


def test_pools_file_is_read(tmp_path):
    path = tmp_path / "pools.toml"
    path.write_text('default_pool = "batch"\n[pools.interactive]\npriorities = [1, 2]\nspill_to = ["batch"]\n'
                    '[pools.batch]\npriorities = [0]\nspill_to = ["interactive"]\n')
    assert PoolsConfig.from_file(path) == POOLS
    path.write_text("[pools\n")
    with pytest.raises(ValueError, match="pools file"):
        PoolsConfig.from_file(path)


def test_a_bad_pools_file_is_named_in_every_error(tmp_path):
    path = tmp_path / "pools.toml"
    path.write_text('[pools.a]\nspill_to = ["nope"]\n')
    with pytest.raises(ValueError) as err:
        PoolsConfig.from_file(path)
    assert str(err.value) == f"pools file {path}: pool 'a': spill_to names 'nope', which is not another pool"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError) as err:
        PoolsConfig.from_file(path)
    assert str(err.value).startswith(f"pools file {path}: 'utf-8' codec can't decode byte 0xff in position 0")
    with pytest.raises(IsADirectoryError):
        PoolsConfig.from_file(tmp_path)


def test_pure_choice_own_pool_first_then_idle_spill_target():
    i0, i1, b0 = ex("i0", "interactive"), ex("i1", "interactive"), ex("b0", "batch")
    room = {"i0": False, "i1": True, "b0": True}
    idle = {"i0": False, "i1": False, "b0": True}

    def choose(priority):
        c = candidate_executors(POOLS, priority, [i0, i1, b0], lambda e: room[e.executor_id],
                                lambda e, fraction: idle[e.executor_id])
        return c.pool, [e.executor_id for e in c.executors], c.spilled

    assert choose(1) == ("interactive", ["i1"], False)
    assert choose(0) == ("batch", ["b0"], False)
    room["i1"] = False                      # interactive saturated, batch idle: spill
    assert choose(2) == ("batch", ["b0"], True)
    idle["b0"] = False                      # batch busy: wait
    assert choose(2) == ("interactive", [], False)
    room.update(b0=False)                   # batch saturated, interactive busy: wait
    assert choose(0) == ("batch", [], False)
    assert candidate_executors(None, 5, [i0, b0], lambda e: True, lambda e, f: False).executors == (i0, b0)


def test_a_request_stays_in_its_pool_while_it_has_room():
    core = core_with(ex("i0", "interactive"), ex("b0", "batch"))
    core.submit(req("hi", 1))
    core.submit(req("lo", 0))
    assert placed(core) == [("hi", "i0"), ("lo", "b0")]


def test_saturated_pool_spills_into_an_idle_pool_only():
    core = core_with(ex("i0", "interactive", num_blocks=2), ex("b0", "batch", num_blocks=8))
    core.submit(req("h1", 1, tokens=31))     # 2 blocks: fills i0
    core.submit(req("h2", 1))                # i0 full, b0 idle (8/8 free): spills to b0
    assert placed(core) == [("h1", "i0"), ("h2", "b0")]
    core.submit(req("h3", 1))                # b0 now has 7/8 available (>= 50 %) but b0's engine reports
    core.registry.report("b0", 7, 1, 1, {l.lease_id for l in core.registry.get("b0").leases.values()})
    assert placed(core) == []                # a waiting request: b0 is busy, h3 waits for i0
    core.registry.report("b0", 7, 1, 0, set())
    assert placed(core) == [("h3", "b0")]


def test_spill_needs_the_target_pool_half_free():
    core = core_with(ex("i0", "interactive", num_blocks=1), ex("b0", "batch", num_blocks=4))
    core.submit(req("b1", 0, tokens=47))     # 3 of b0's 4 blocks: 1/4 available < 50 %
    core.submit(req("h1", 1))                # i0 (1 block) takes it
    core.submit(req("h2", 1))                # i0 full; b0 not idle: waits
    assert placed(core) == [("b1", "b0"), ("h1", "i0")]  # fcfs order: b1, h1, h2
    assert len(core) == 1 and core.queued()[0].request_id == "h2"


def test_blocked_pool_does_not_hold_up_another_pool():
    core = core_with(ex("i0", "interactive", num_blocks=1), ex("b0", "batch", num_blocks=8))
    core.registry.report("b0", 3, 1, 0, set())       # b0 busy (3 of 8 blocks free, < 50 %): no spill
    core.submit(req("h1", 1, tokens=20))              # 2 blocks: never fits i0 ... but fits b0
    core.submit(req("lo", 0))
    assert placed(core) == [("lo", "b0")]             # h1 waits for the spill target; lo goes on


def test_no_executor_in_reachable_pools_is_unavailable():
    core = AdmissionCore(SchedulerConfig(pools=PoolsConfig.from_dict({"pools": {"gold": {"priorities": [9]}}})))
    core.registry.add(ex("b0", "batch"))
    with pytest.raises(Unavailable, match="pool 'gold'"):
        core.submit(req("x", 9))
    with pytest.raises(Unavailable, match="pool 'default'"):
        core.submit(req("y", 0))  # priority 0 → the default pool "default": none either


def test_scheduler_config_reads_the_pools_file_and_cli_rejects_a_bad_one(tmp_path):
    from typer.testing import CliRunner

    from meshserve.cli import app
    from meshserve.cli.processes import scheduler_config

    path = tmp_path / "pools.toml"
    path.write_text('[pools.gold]\npriorities = [5]\n')
    config = scheduler_config(pools_file=str(path))
    assert config.pools.pool_of(5) == "gold" and config.routing.policy == "prefix"
    path.write_text('[pools.gold]\nspill_to = ["silver"]\n')
    result = CliRunner().invoke(app, ["scheduler", "--pools", str(path), "--insecure"])
    assert result.exit_code == 2 and "spill_to names 'silver'" in result.output
    result = CliRunner().invoke(app, ["scheduler", "--routing", "random", "--insecure"])
    assert result.exit_code == 2 and "unknown routing policy" in result.output


def test_engine_with_waiting_requests_gets_no_new_assignment():
    """The queue stays in the scheduler (where SJF/priority order it) instead of
    piling up in an engine's first-come queue."""
    core = core_with(ex("b0", "batch", num_blocks=8), ex("b1", "batch", num_blocks=8))
    core.registry.report("b0", 8, 1, 1, set())       # b0's engine queues a request
    core.registry.report("b1", 8, 1, 1, set())       # so does b1's
    core.submit(req("x", 0))
    assert placed(core) == []
    core.registry.report("b1", 8, 1, 0, set())       # b1 runs everything it holds
    assert placed(core) == [("x", "b1")]
