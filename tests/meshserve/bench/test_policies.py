"""``meshserve.bench.policies``: its pure parts (``policy_workload``: workload, statistics,
arm order, tenants file) and its options. The experiments themselves are runs that print
numbers; no test times them."""

import math
import tomllib

import pytest

from meshserve.bench.policies import parse_args
from meshserve.bench.policy_workload import (Job, JobSpec, Outcome, a_clients, arm_order, call_counts, latency_stats,
                                             log_sigma, make_jobs, ratio, tenants_toml, ttft_stats)

SPECIALS = frozenset(range(17))


def test_same_seed_same_jobs_other_seed_differs():
    spec = JobSpec(num_requests=40)
    a, b = make_jobs(spec, 3, 49152, SPECIALS), make_jobs(spec, 3, 49152, SPECIALS)
    assert a == b
    c = make_jobs(spec, 4, 49152, SPECIALS)
    assert [j.prompt_token_ids for j in c] != [j.prompt_token_ids for j in a]


def test_jobs_follow_the_spec():
    spec = JobSpec(num_requests=2000, output_median=12, output_sigma=1.2, output_range=(2, 128), rate=8.0)
    jobs = make_jobs(spec, 0, 49152, SPECIALS, tenant="b", prefix="x")
    outs = sorted(j.output_len for j in jobs)
    assert outs[len(outs) // 2] == pytest.approx(12, rel=0.15)
    assert 2 <= outs[0] and outs[-1] <= 128
    assert log_sigma(outs) >= 1.0  # heavy tail survives the clipping
    prompts = [len(j.prompt_token_ids) for j in jobs]
    assert 16 <= min(prompts) and max(prompts) <= 128
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert arrivals[-1] / len(jobs) == pytest.approx(1 / 8.0, rel=0.1)
    assert all(t not in SPECIALS and 0 <= t < 49152 for j in jobs[:50] for t in j.prompt_token_ids)
    assert {j.tenant for j in jobs} == {"b"} and len({j.request_id for j in jobs}) == 2000


def test_fixed_lengths_are_exact():
    spec = JobSpec(num_requests=5, prompt_median=48, prompt_sigma=0.0, prompt_range=(48, 48), output_median=32,
                   output_sigma=0.0, output_range=(32, 32))
    jobs = make_jobs(spec, 1, 1000)
    assert all(len(j.prompt_token_ids) == 48 and j.output_len == 32 and j.size == 80 for j in jobs)


def test_bad_spec_and_vocabulary():
    with pytest.raises(ValueError):
        JobSpec(num_requests=0)
    with pytest.raises(ValueError):
        JobSpec(num_requests=1, output_median=200, output_range=(2, 128))
    with pytest.raises(ValueError):
        make_jobs(JobSpec(num_requests=1), 0, 17, SPECIALS)


def _o(i, prompt, output, sent, finished, ttft=None, queue_s=0.0, error="", updates=0):
    job = Job(f"r{i}", "default", 0.0, tuple(range(prompt)), output)
    return Outcome(job, sent, finished, ttft_s=ttft, queue_s=queue_s, num_tokens=output, error=error,
                   queue_updates=updates)


def test_latency_stats_halves_by_true_size():
    outs = [_o(0, 10, 2, 0.0, 1.0, queue_s=0.5), _o(1, 10, 50, 0.0, 9.0, queue_s=3.0, updates=2),
            _o(2, 10, 4, 1.0, 3.0, queue_s=0.1), _o(3, 10, 40, 1.0, 6.0, queue_s=2.0, updates=1),
            _o(4, 10, 99, 0.0, 100.0, error="UNAVAILABLE")]
    s = latency_stats(outs)
    assert s["num_ok"] == 4 and s["num_errors"] == 1
    assert s["short_half_mean_latency_s"] == pytest.approx((1.0 + 2.0) / 2)
    assert s["short_half_p99_latency_s"] == 2.0
    assert s["long_half_mean_latency_s"] == pytest.approx((9.0 + 5.0) / 2)
    assert s["long_half_p99_latency_s"] == 9.0
    assert s["mean_latency_s"] == pytest.approx(17.0 / 4)
    assert s["max_wait_s"] == 3.0 and s["queued_calls"] == 2
    assert s["throughput_requests_per_s"] == pytest.approx(4 / 9.0)
    with pytest.raises(ValueError):
        latency_stats(outs[:1])


def test_ttft_stats_and_counts():
    outs = [_o(i, 5, 5, 0.0, 1.0, ttft=0.1 * (i + 1)) for i in range(10)]
    outs.append(_o(10, 5, 5, 0.0, 1.0, error="RESOURCE_EXHAUSTED"))
    outs.append(_o(11, 5, 5, 0.0, 1.0, ttft=0.05, updates=3))
    t = ttft_stats(outs)
    assert t["num_ok"] == 11 and t["ttft_p99_s"] == pytest.approx(1.0) and t["ttft_p50_s"] == pytest.approx(0.5)
    assert ttft_stats([])["ttft_p99_s"] is None
    c = call_counts(outs)
    assert c == {"calls": 12, "ok": 11, "resource_exhausted": 1, "errors": {"RESOURCE_EXHAUSTED": 1}, "queued": 1}


def test_ratio_arms_tenants_clients():
    assert ratio(1.0, 2.0) == 0.5 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    assert arm_order(("fcfs", "sjf"), 3) == ["fcfs", "sjf", "sjf", "fcfs", "fcfs", "sjf"]
    tenants = tomllib.loads(tenants_toml(8))["tenants"]
    assert tenants[0] == {"name": "a", "api_keys": ["key-a"], "kv_quota_blocks": 8}
    assert tenants[1]["name"] == "b" and "kv_quota_blocks" not in tenants[1]
    assert a_clients(8, 10.0, 48, 16) == 20  # each call is charged ceil(49 / 16) = 4 blocks
    assert a_clients(1, 1.0, 48, 16) == 1


def test_parse_args():
    o = parse_args(["--experiment", "quota-isolation", "--seed", "5", "--quota-blocks", "12"])
    assert o.experiment == "quota-isolation" and o.seed == 5 and o.quota_blocks == 12 and o.rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--experiment", "nope"])
    assert math.isclose(parse_args(["--experiment", "sjf-vs-fcfs"]).aging_bound_s, 20.0)
