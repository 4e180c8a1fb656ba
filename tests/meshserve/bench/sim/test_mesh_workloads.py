"""The mesh simulations on small seeded instances: prefix routing and quota isolation meet their goals."""

import json

from typer.testing import CliRunner

from meshserve.bench.sim.prefix_routing import RoutingSimConfig, compare, ideal_hit_tokens, workload
from meshserve.bench.sim.quota_isolation import IsolationSimConfig
from meshserve.bench.sim.quota_isolation import run as run_isolation
from meshserve.cli import app


def test_prefix_routing_hits_at_least_80_percent_of_ideal_with_balanced_executors():
    report = compare(RoutingSimConfig(seed=0, num_requests=300))
    assert report["hit_rate_vs_ideal"] >= 0.8
    assert report["busiest_over_mean"] <= 1.5
    assert sum(report["requests_per_executor"].values()) == 300
    # the least-loaded baseline balances as well but loses the hits
    assert report["baseline"]["hit_rate_vs_ideal"] < 0.7
    assert report["hit_rate"] > report["baseline"]["hit_rate"] + 0.2


def test_prefix_routing_workload_and_ideal_are_exact():
    cfg = RoutingSimConfig(seed=1, num_requests=20, num_system_prompts=2, system_prompt_tokens=40)
    jobs = workload(cfg)
    assert [j.block_hashes[:2] for j in jobs if j.group == 0][0] == [j.block_hashes[:2] for j in jobs
                                                                      if j.group == 0][-1]
    # two full blocks (32 of 40 tokens) hit for every request but the first of each prompt
    firsts = len({j.group for j in jobs})
    assert ideal_hit_tokens(cfg, jobs) == 32 * (20 - firsts)


def test_quota_isolation_keeps_the_other_tenants_p99_ttft_within_1_5x():
    report = run_isolation(IsolationSimConfig(seed=0, num_b_requests=300))
    assert report["a_clients"] == 10  # 10 x (32 // ceil(257 / 16)) = 10 x 1: A wants 10x what its quota admits
    assert report["b_p99_ratio"] <= 1.5
    assert report["b_p99_ratio_without_quota"] > 3.0  # what the quota prevents


def test_cli_sim_workloads_write_reproducible_reports(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["sim", "--workload", "prefix-routing", "--seed", "2", "--num-requests", "100",
                                      "--report-json", str(out)])
    assert result.exit_code == 0, result.output
    assert "hit_rate_vs_ideal" in result.output
    again = compare(RoutingSimConfig(seed=2, num_requests=100))
    assert json.loads(out.read_text()) == json.loads(json.dumps(again))
    result = CliRunner().invoke(app, ["sim", "--workload", "nope"])
    assert result.exit_code == 2 and "unknown workload" in result.output
