"""Case C23: no starvation under prefix-aware routing or shortest-job-first order (mesh simulator).

Both runs use the real admission core, prefix index and routing on simulated executors
(``meshserve.bench.sim.loop``); the times are the simulator's, deterministic, pinned to 1 µs.
The exact-order version of the second run on the bare core is
``tests/scheduler/test_queue_policy.py::test_long_request_among_a_stream_of_short_ones_is_served_within_the_bound``.
"""

import statistics

import pytest

from meshserve.bench.sim.loop import Job, MeshSimConfig, simulate
from meshserve.block_hash import routing_block_hashes

SYSTEM = list(range(1000, 1512))  # the shared 512-token system prompt


def _hashes(tokens):
    return routing_block_hashes(tokens, 16, "sim", "r0")


def _outcome(reqs):
    special, stream = reqs[-1], [r for r in reqs[:-1] if r is not None]
    return (special.first_token - special.arrival, special.assigned - special.arrival, special.finished,
            statistics.median(r.first_token - r.arrival for r in stream), max(r.finished for r in stream))


def test_cold_prompt_among_a_hot_shared_prefix_stream_is_not_starved():
    """Case C23, first run: prefix-aware routing, FCFS."""
    # 16 closed-loop clients send the shared prompt + a unique 16-token question (max_tokens 32) faster than
    # 2 executors of 4 sequences each serve them; at t = 2 s one cold request with a unique 512-token prompt.
    jobs = []
    for client in range(16):
        for k in range(30):
            tokens = SYSTEM + [5000 + (client * 1000 + k) * 16 + j for j in range(16)]
            jobs.append(Job("t", len(tokens), 32, _hashes(tokens), client=client))
    cold = list(range(90000, 90512))
    jobs.append(Job("t", 512, 32, _hashes(cold), arrival=2.0, group=1))
    cfg = MeshSimConfig(num_executors=2, num_blocks=256, max_num_seqs=4, queue_policy="fcfs", routing="prefix")
    reqs, _, _ = simulate(cfg, jobs)
    ttft, wait, finished, hot_median_ttft, hot_end = _outcome(reqs)
    assert ttft <= 5 * hot_median_ttft and finished < hot_end  # the case's bound; done while the stream runs
    assert (ttft, wait, finished, hot_median_ttft, hot_end) == pytest.approx(
        (0.6376, 0.5761, 2.9645, 0.3537, 20.8575), abs=1e-6)
    assert reqs[-1].hit_tokens == 0 and all(r.hit_tokens == 512 for r in reqs[:-1] if r.first_token > 1.0)


def test_long_request_among_a_stream_of_short_ones_under_sjf_waits_at_most_the_aging_bound():
    """Case C23, second run: shortest job first with an aging bound."""
    # 96 closed-loop clients of 64-token prompts (max_tokens 32) keep the scheduler's queue full; at t = 2 s one
    # 2000-token request (126 blocks of an executor's 160) arrives. SJF puts it last until it has waited the
    # aging bound; then it heads the queue and the walk holds smaller requests back until it fits.
    def run(max_queue_wait_s):
        jobs = [Job("t", 64, 32, [], client=c) for c in range(96) for _ in range(12)]
        jobs.append(Job("t", 2000, 32, [], arrival=2.0))
        cfg = MeshSimConfig(num_executors=2, num_blocks=160, max_num_seqs=64, queue_policy="sjf",
                            max_queue_wait_s=max_queue_wait_s)
        return _outcome(simulate(cfg, jobs)[0])

    ttft, wait, finished, short_median_ttft, stream_end = run(1.0)
    assert wait >= 1.0 and ttft <= 5 * short_median_ttft and finished < stream_end
    assert (ttft, wait, finished, short_median_ttft, stream_end) == pytest.approx(
        (1.373, 1.1169, 3.7415, 0.56955, 13.3007), abs=1e-6)
    # with a 30 s bound it waits until the stream thins out: 9.8 s, far beyond 5 x the median TTFT
    ttft_30, wait_30, *_ = run(30.0)
    assert wait_30 == pytest.approx(9.7951, abs=1e-6) and ttft_30 > 5 * short_median_ttft
