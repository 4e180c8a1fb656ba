"""The simulator on a small seeded heavy-tail workload: SJF vs FCFS, aging bound, reproducibility."""

import json

from typer.testing import CliRunner

from meshserve.bench.sim.heavy_tail import HeavyTailSimConfig, run
from meshserve.cli import app


def test_sjf_halves_short_request_latency_within_the_aging_bound():
    fcfs = run(HeavyTailSimConfig(policy="fcfs", num_requests=600, seed=0))
    sjf = run(HeavyTailSimConfig(policy="sjf", num_requests=600, seed=0))
    assert sjf["output_len_log_sigma"] >= 1.0
    assert sjf["short_half_mean_latency_s"] <= 0.5 * fcfs["short_half_mean_latency_s"]
    assert sjf["max_wait_s"] <= sjf["aging_bound_s"]
    assert sjf["predictor"]["num_observed"] == 600


def test_same_seed_same_report_and_cli_writes_it(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["sim", "--policy", "sjf", "--seed", "3", "--num-requests", "120",
                                      "--report-json", str(out)])
    assert result.exit_code == 0, result.output
    again = run(HeavyTailSimConfig(policy="sjf", seed=3, num_requests=120, max_queue_wait_s=60.0))
    assert json.loads(out.read_text()) == json.loads(json.dumps(again))
    assert run(HeavyTailSimConfig(policy="sjf", seed=4, num_requests=120)) != again
