"""``meshserve.bench.burst_order``: a burst's per-request first tokens, the engine in each
prefill order, on the bench's own targets."""

from __future__ import annotations

import pytest

from meshserve.bench.burst_order import ROUND_SEED_STRIDE, burst_figures, run
from meshserve.bench.config import BenchConfig
from meshserve.bench.loop import RequestResult
from meshserve.bench.workload import WorkloadSpec


def test_burst_figures_are_the_rounds_ttfts_and_first_tokens():
    results = [RequestResult("a", 10, 2, 1.0, (1.5, 1.75), 1.75), RequestResult("b", 4, 4, 1.25, (1.5, 2.0), 2.5),
               RequestResult("c", 8, 3, 1.0, (2.0, 2.25, 2.5), 2.5)]
    assert burst_figures(results, 2.25) == {
        "ttft_p50_ms": 500.0, "ttft_mean_ms": pytest.approx(1750 / 3), "ttft_p90_ms": 900.0, "ttft_max_ms": 1000.0,
        "output_tokens_per_s": 4.0, "first_token_ms": [500, 500, 1000]}


@pytest.mark.model
async def test_each_prefill_order_runs_every_request_of_each_round():
    spec = WorkloadSpec(num_requests=4, seed=5, prompt_len_median=24, prompt_len_range=(16, 40), output_len_median=3,
                        output_len_range=(2, 4))
    cfg = BenchConfig("engine", 4, spec, warmup=0, dtype="float32", kv_cache_memory="64MiB", num_threads=1,
                      max_num_batched_tokens=48)
    runs = await run(cfg, ["shortest", "arrival"], rounds=2)
    assert [(r["round"], r["seed"], r["system"]) for r in runs] == [
        (0, 5, "shortest"), (0, 5, "arrival"), (1, 5 + ROUND_SEED_STRIDE, "shortest"),
        (1, 5 + ROUND_SEED_STRIDE, "arrival")]
    assert all(len(r["first_token_ms"]) == 4 and r["ttft_max_ms"] >= r["ttft_p50_ms"] > 0 for r in runs)
