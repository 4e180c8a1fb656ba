"""The batch scheduler reports each preemption with the request's next output
(``RequestOutput.preempted_at_ns``, the executor's span events), once."""

from __future__ import annotations

import time

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.config import BatchSchedulerConfig
from executor.engine.kv_cache_manager import KVCacheManager
from tests.support.engine_steps import make_request, run_step


def test_preemption_times_come_with_the_next_output_once():
    s = BatchScheduler(BatchSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100),
                       KVCacheManager(4, 4), frozenset())
    b = make_request("b", 4, max_tokens=8, priority=1)
    s.add_request(b)
    run_step(s)
    a = make_request("a", 8, max_tokens=3)
    s.add_request(a)
    _, results = run_step(s)
    assert [(r.request_id, r.preempted_at_ns) for r in results] == [("b", ()), ("a", ())]
    before = time.time_ns()
    out, results = run_step(s)  # a's decode needs a 3rd block: a, the lowest, is preempted
    after = time.time_ns()
    assert out.preempted_request_ids == ["a"] and [r.request_id for r in results] == ["b"]
    reported: list[tuple[int, ...]] = []
    while s.has_unfinished_requests():
        _, results = run_step(s)
        reported += [r.preempted_at_ns for r in results if r.request_id == "a"]
    assert len(reported) == 2  # a's 2nd and 3rd tokens, after its recompute
    assert len(reported[0]) == 1 and before <= reported[0][0] <= after
    assert reported[1] == ()
    assert a.num_preemptions == 1 and a.preempted_at_ns == []
