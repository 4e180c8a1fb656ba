"""``meshserve bench``: the workload, the closed loop, the report, and tiny real runs."""

import asyncio
import statistics

import pytest

from meshserve.bench import BenchConfig, WorkloadSpec, run_bench
from meshserve.bench.loop import BenchError, RequestResult, checked_result, run_closed_loop
from meshserve.bench.report import build_report, percentile
from meshserve.bench.workload import BenchRequest, make_warmup, make_workload, model_vocabulary, special_token_ids

SPECIALS = frozenset(range(17))  # SmolLM2's control ids


# --- workload -----------------------------------------------------------------


def test_same_seed_same_workload_other_seed_differs():
    spec = WorkloadSpec(num_requests=50, seed=7)
    a, b = make_workload(spec, 49152, SPECIALS), make_workload(spec, 49152, SPECIALS)
    assert a.requests == b.requests
    c = make_workload(WorkloadSpec(num_requests=50, seed=8), 49152, SPECIALS)
    assert [r.prompt_token_ids for r in c.requests] != [r.prompt_token_ids for r in a.requests]


def test_lengths_follow_the_spec():
    wl = make_workload(WorkloadSpec(num_requests=400, seed=0), 49152, SPECIALS)
    assert statistics.median(wl.prompt_lens) == pytest.approx(150, rel=0.15)
    assert statistics.median(wl.output_lens) == pytest.approx(128, rel=0.15)
    assert 16 <= min(wl.prompt_lens) and max(wl.prompt_lens) <= 1024
    assert 8 <= min(wl.output_lens) and max(wl.output_lens) <= 512
    assert len({r.request_id for r in wl.requests}) == 400


def test_prompts_use_only_ordinary_ids():
    wl = make_workload(WorkloadSpec(num_requests=400, seed=1), 49152, SPECIALS)
    ids = {t for r in wl.requests for t in r.prompt_token_ids}
    assert not ids & SPECIALS
    assert min(ids) >= 17 and max(ids) < 49152
    assert len(ids) > 30000  # ~67k uniform draws over 49135 ids: ~36.6k distinct expected


def test_tiny_vocabulary_draws_only_the_ordinary_ids():
    wl = make_workload(WorkloadSpec(num_requests=20, seed=3), 20, SPECIALS)
    assert {t for r in wl.requests for t in r.prompt_token_ids} == {17, 18, 19}


def test_warmup_is_its_own_stream_with_short_outputs():
    spec = WorkloadSpec(num_requests=4, seed=0)
    wl, warm = make_workload(spec, 49152, SPECIALS), make_warmup(spec, 3, 49152, SPECIALS)
    assert [r.request_id for r in warm.requests] == ["warmup-0", "warmup-1", "warmup-2"]
    assert all(r.output_len <= 16 for r in warm.requests)
    assert not {r.prompt_token_ids for r in warm.requests} & {r.prompt_token_ids for r in wl.requests}
    assert make_warmup(spec, 0, 49152, SPECIALS) is None


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(output_len_median=4), dict(prompt_len_median=2000),
                                 dict(prompt_len_range=(0, 8), prompt_len_median=4)])
def test_bad_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**{"num_requests": 1, **bad})


def test_special_ids_come_from_the_tokenizer(tokenizer, default_model_files):
    assert special_token_ids(tokenizer) == SPECIALS
    assert model_vocabulary(default_model_files.path) == (49152, SPECIALS)


# --- statistics and timings ---------------------------------------------------


def test_percentile_exact_values():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 25) == 1.75
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 100) == 4.0
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_request_timings():
    r = RequestResult("r", 10, 3, submit_time=1.0, token_times=(1.5, 1.75, 2.5), end_time=3.0)
    assert (r.ttft_s, r.tpot_s, r.e2e_s) == (0.5, 0.5, 2.0)
    one = RequestResult("r", 10, 1, submit_time=1.0, token_times=(1.25,), end_time=1.5)
    assert one.tpot_s == 0.0


def test_a_wrong_token_count_raises():
    req = BenchRequest("bench-0", (20, 21), output_len=3)
    assert checked_result(req, 0.0, [1.0, 2.0, 3.0], 3.0).output_len == 3
    with pytest.raises(BenchError, match="exactly 3 tokens .* received 2"):
        checked_result(req, 0.0, [1.0, 2.0], 3.0)


def _fake_requests(n):
    return [BenchRequest(f"bench-{i}", (20,) * (i + 1), output_len=2) for i in range(n)]


async def test_closed_loop_keeps_concurrency_and_order():
    in_flight, peak, order = 0, 0, []

    async def send(req):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        order.append(req.request_id)
        await asyncio.sleep(0.001 * (len(req.prompt_token_ids) % 3))
        in_flight -= 1
        return checked_result(req, 0.0, [1.0, 2.0], 2.0)

    reqs = _fake_requests(10)
    results, wall = await run_closed_loop(reqs, 3, send)
    assert peak == 3
    assert order[:3] == ["bench-0", "bench-1", "bench-2"]  # taken from the list in order
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert wall >= 0.0


async def test_closed_loop_raises_the_first_failure():
    async def send(req):
        if req.request_id == "bench-2":
            return checked_result(req, 0.0, [1.0], 1.0)
        await asyncio.sleep(0)
        return checked_result(req, 0.0, [1.0, 2.0], 2.0)

    with pytest.raises(ExceptionGroup) as info:
        await run_closed_loop(_fake_requests(5), 2, send)
    assert info.group_contains(BenchError)


def test_report_values():
    spec = WorkloadSpec(num_requests=2, seed=5)
    wl = make_workload(spec, 49152, SPECIALS)
    cfg = BenchConfig("hf-generate", concurrency=8, workload=spec)
    results = [RequestResult("a", 10, 4, 0.0, (1.0, 2.0, 3.0, 4.0), 4.0),
               RequestResult("b", 20, 2, 1.0, (1.5, 3.5), 4.0)]
    report = build_report(cfg, wl, results, wall_s=3.0, target_facts={"dtype": "float32"})
    assert report["concurrency"] == 1  # hf-generate runs one request at a time
    assert report["total_output_tokens"] == 6 and report["total_prompt_tokens"] == 30
    assert report["output_tokens_per_s"] == 2.0
    assert report["ttft_p50_s"] == 0.75 and report["tpot_p50_s"] == 1.5 and report["e2e_p50_s"] == 3.5
    assert report["prompt_len_median"] == statistics.median(wl.prompt_lens)
    assert report["dtype"] == "float32" and "ttft_method" in report


def test_config_validation():
    spec = WorkloadSpec(num_requests=1)
    for bad in (dict(target="vllm"), dict(concurrency=0), dict(dtype="int8"), dict(target="engine", addr="x:1"),
                dict(warmup=-1), dict(executors=0), dict(kv_cache_memory="lots")):
        with pytest.raises(ValueError):
            BenchConfig(**{"target": "mesh", "concurrency": 1, "workload": spec, **bad})


# --- tiny real runs -----------------------------------------------------------

REPORT_KEYS = {"target", "concurrency", "num_requests", "seed", "dtype", "output_tokens_per_s", "total_output_tokens",
               "wall_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s", "prompt_len_median",
               "output_len_median"}
TINY = WorkloadSpec(num_requests=4, seed=0, prompt_len_median=32, output_len_median=6,
                    prompt_len_range=(16, 64), output_len_range=(3, 12))


@pytest.mark.model
@pytest.mark.parametrize("target", ["engine", "hf-generate"])
async def test_tiny_real_run(target, default_model_files):
    cfg = BenchConfig(target, concurrency=2, workload=TINY, warmup=1, dtype="float32", kv_cache_memory="64MiB")
    report = await run_bench(cfg)
    expected = make_workload(TINY, *model_vocabulary(default_model_files.path))
    assert REPORT_KEYS <= report.keys()
    assert report["total_output_tokens"] == sum(expected.output_lens)
    assert [r["output_len"] for r in report["requests"]] == expected.output_lens
    assert (report["target"], report["num_requests"], report["dtype"]) == (target, 4, "float32")
    assert report["concurrency"] == (2 if target == "engine" else 1)
    assert ("engine" in report) == (target == "engine")
    if target == "engine":
        assert report["engine"]["num_blocks"] > 0 and report["engine"]["kv_cache_memory"] == "64MiB"


@pytest.mark.model
async def test_tiny_real_run_against_a_running_gateway(tokenizer, default_model_files):
    """The mesh target's client path (``--addr``) against an in-process mesh."""
    from executor.engine.config import CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from tests.mesh_harness import start_local_mesh

    cache = CacheConfig(kv_cache_memory_bytes=64 << 20)
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=1024, cache=cache))
    mesh = await start_local_mesh([engine], tokenizer)
    try:
        cfg = BenchConfig("mesh", concurrency=3, workload=TINY, warmup=0, addr=mesh.gateway.address)
        report = await run_bench(cfg)
    finally:
        await mesh.stop()
    expected = make_workload(TINY, *model_vocabulary(default_model_files.path))
    assert REPORT_KEYS <= report.keys()
    assert report["total_output_tokens"] == sum(expected.output_lens)
    assert (report["addr"], report["concurrency"], report["dtype"]) == (mesh.gateway.address, 3, "auto")
