"""``meshserve bench``: the workloads, the closed loop, the engine counters, the report, the
summary, and tiny real runs. (Over 400 lines: one test module per benchmark command, as the
source's ``meshserve/bench/`` pipeline is one command.)"""

import asyncio
import json
import statistics
from collections import Counter

import pytest

from meshserve.bench import BenchConfig, WorkloadSpec, run_bench
from meshserve.bench.engine_stats import NULL_METRICS, CounterSnapshot, Sample, StatsSampler, run_metrics
from meshserve.bench.loop import BenchError, RequestResult, checked_result, run_closed_loop
from meshserve.bench.report import build_report, format_table
from meshserve.bench.shared_prefix import make_shared_prefix_workload
from meshserve.bench.summary import summarise
from meshserve.bench.workload import (BenchRequest, make_warmup, make_workload, model_vocabulary,
                                      special_token_ids)
from meshserve.bench.workload_kinds import load_workloads

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
                                 dict(prompt_len_range=(0, 8), prompt_len_median=4), dict(kind="sharegpt"),
                                 dict(kind="shared-prefix", shared_prefix_len=0), dict(shared_fraction=1.5)])
def test_bad_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**{"num_requests": 1, **bad})


def test_special_ids_come_from_the_tokenizer(tokenizer, default_model_files):
    assert special_token_ids(tokenizer) == SPECIALS
    assert model_vocabulary(default_model_files.path) == (49152, SPECIALS)


def _shared_spec(**kw):
    return WorkloadSpec(**{"num_requests": 20, "seed": 3, "kind": "shared-prefix", "prompt_len_median": 24,
                           "output_len_median": 8, "prompt_len_range": (8, 64), "output_len_range": (4, 16), **kw})


def test_shared_prefix_workload_is_seeded_and_70_percent_share_the_exact_prefix(tokenizer):
    spec = _shared_spec()
    wl = make_shared_prefix_workload(spec, tokenizer, 49152)
    assert wl.requests == make_shared_prefix_workload(spec, tokenizer, 49152).requests
    other = make_shared_prefix_workload(_shared_spec(seed=4), tokenizer, 49152)
    assert [r.prompt_token_ids for r in other.requests] != [r.prompt_token_ids for r in wl.requests]

    prefixes = Counter(r.prompt_token_ids[:400] for r in wl.requests)
    prefix, count = prefixes.most_common(1)[0]
    assert count == 14  # round(0.7 * 20)
    assert tokenizer.decode(prefix).startswith("You are a careful and friendly assistant")
    shared = [r for r in wl.requests if r.prompt_token_ids[:400] == prefix]
    unique = [r for r in wl.requests if r.prompt_token_ids[:400] != prefix]
    # the user parts differ, and the others share not even a first block with anything
    assert len({r.prompt_token_ids for r in shared}) == 14
    assert len({r.prompt_token_ids[:16] for r in unique} | {prefix[:16]}) == 7
    # same length distribution: 400 + the user length for both kinds
    assert all(400 + 8 <= len(r.prompt_token_ids) <= 400 + 64 for r in wl.requests)
    assert all(4 <= r.output_len <= 16 for r in wl.requests)
    assert not {t for r in wl.requests for t in r.prompt_token_ids} & SPECIALS


@pytest.mark.parametrize("fraction, expected", [(0.0, 0), (0.5, 5), (1.0, 10)])
def test_shared_fraction_sets_how_many_share(tokenizer, fraction, expected):
    spec = _shared_spec(num_requests=10, shared_prefix_len=32, shared_fraction=fraction)
    wl = make_shared_prefix_workload(spec, tokenizer, 49152)
    top = Counter(r.prompt_token_ids[:32] for r in wl.requests).most_common(1)[0][1]
    assert top == max(expected, 1)


def test_load_workloads_picks_the_kind_and_a_synthetic_warmup(default_model_files):
    spec = _shared_spec(num_requests=4, shared_prefix_len=40)
    wl, warm = load_workloads(spec, 2, default_model_files.path)
    assert Counter(r.prompt_token_ids[:40] for r in wl.requests).most_common(1)[0][1] == 3
    assert warm.requests == make_warmup(spec, 2, 49152, SPECIALS).requests
    synthetic, _ = load_workloads(WorkloadSpec(num_requests=4, seed=3), 0, default_model_files.path)
    assert synthetic.requests == make_workload(WorkloadSpec(num_requests=4, seed=3), 49152, SPECIALS).requests


# --- statistics and timings ---------------------------------------------------


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
    assert report["workload"] == "synthetic" and "shared_prefix_len" not in report
    assert all(report[k] is None for k in NULL_METRICS)  # no engine counters


def test_the_terminal_table_names_a_pinned_meshs_cores():
    spec = WorkloadSpec(num_requests=1, seed=5)
    wl = make_workload(spec, 49152, SPECIALS)
    results = [RequestResult("a", 10, 2, 0.0, (1.0, 2.0), 2.0)]
    pinned = build_report(BenchConfig("mesh", 1, spec), wl, results, wall_s=2.0, target_facts={
        "dtype": "float32", "cpus": {"scheduler": "1", "executor-0": "0", "gateway": "1"}})
    assert format_table(pinned).splitlines()[-1] == "cores                   scheduler 1, executor-0 0, gateway 1"
    unpinned = build_report(BenchConfig("mesh", 1, spec), wl, results, wall_s=2.0,
                            target_facts={"dtype": "float32", "cpus": {}})
    assert "cores" not in format_table(unpinned)
    note = "0-1, shared by every service (pinning needs 3: 2 executor(s) x 1 core(s) and one for the other services)"
    refused = build_report(BenchConfig("mesh", 1, spec), wl, results, wall_s=2.0,
                           target_facts={"dtype": "float32", "cpus": {}, "cpu_note": note})
    assert format_table(refused).splitlines()[-1] == f"cores                   {note}"  # says why, as up does


def test_report_carries_the_engine_metrics_and_the_shared_prefix_shape():
    spec = WorkloadSpec(num_requests=1, seed=5, kind="shared-prefix", shared_prefix_len=64, shared_fraction=0.5)
    wl = make_workload(spec, 49152, SPECIALS)
    metrics = run_metrics([_snap()], [_snap(preempt=1, queried=10, hits=5)], [Sample((0.5,), 1)])
    report = build_report(BenchConfig("engine", 1, spec), wl, [RequestResult("a", 10, 2, 0.0, (1.0, 2.0), 2.0)],
                          wall_s=2.0, target_facts={"dtype": "float32"}, engine_metrics=metrics)
    assert (report["workload"], report["shared_prefix_len"], report["shared_fraction"]) == ("shared-prefix", 64, 0.5)
    assert report["prefix_cache_hit_rate"] == 0.5 and report["num_preemptions"] == 1
    assert report["max_num_running"] == 1 and report["kv_capacity"]["requests_fit_reserved"] == 3
    assert "ttft_method" not in report


def test_config_validation():
    spec = WorkloadSpec(num_requests=1)
    for bad in (dict(target="vllm"), dict(concurrency=0), dict(dtype="int8"), dict(target="engine", addr="x:1"),
                dict(warmup=-1), dict(executors=0), dict(kv_cache_memory="lots"), dict(block_size=0),
                dict(max_batch_wait_ms=-1.0), dict(max_batch_wait_ms=float("inf")), dict(stats_interval_s=0),
                dict(executor_addrs=("x:2",))):
        with pytest.raises(ValueError):
            BenchConfig(**{"target": "mesh", "concurrency": 1, "workload": spec, **bad})
    assert BenchConfig("mesh", 1, spec, addr="x:1", executor_addrs=("x:2",)).executor_addrs == ("x:2",)
    assert BenchConfig("hf-static", 8, spec).effective_concurrency == 8
    assert BenchConfig("hf-continuous", 8, spec).effective_concurrency == 8
    with pytest.raises(ValueError, match="prefill_order must be one of shortest, arrival, got 'sjf'"):
        BenchConfig("engine", 1, spec, prefill_order="sjf")
    assert BenchConfig("engine", 1, spec, prefill_order="arrival").prefill_order == "arrival"


# --- engine counters ----------------------------------------------------------


def _snap(running=0, util=1.0, preempt=0, queried=0, hits=0, blocks=100, steps=0):
    return CounterSnapshot(num_blocks=blocks, block_size=16, max_model_len=512, num_running=running,
                           kv_cache_utilization=util, num_preemptions=preempt, prefix_cache_queried_tokens=queried,
                           prefix_cache_hit_tokens=hits, num_steps=steps)


def test_run_metrics_are_deltas_and_samples_of_busy_engines():
    before = [_snap(preempt=2, queried=100, hits=10, steps=7), _snap(queried=50, blocks=60)]
    after = [_snap(preempt=5, queried=300, hits=110, steps=40),
             _snap(preempt=1, queried=250, hits=50, blocks=60, steps=5)]
    samples = [Sample.of([_snap(running=3, util=0.5), _snap(running=0, util=1.0)]),  # the idle 1.0 is ignored
               Sample.of([_snap(running=2, util=0.75), _snap(running=4, util=0.25)])]
    m = run_metrics(before, after, samples)
    assert m["kv_cache_utilization"] == {"mean": 0.5, "max": 0.75, "num_samples": 3}
    assert (m["prefix_cache_queried_tokens"], m["prefix_cache_hit_tokens"]) == (400, 150)
    assert m["prefix_cache_hit_rate"] == 150 / 400
    assert m["num_preemptions"] == 4
    assert m["max_num_running"] == 6
    assert m["num_steps"] == 38
    assert m["mean_num_running"] == (3 + 6) / 2
    assert m["kv_capacity"] == {"num_blocks": 160, "block_size": 16, "max_model_len": 512, "requests_fit_paged": 6,
                                "requests_fit_reserved": 100 * 16 // 512 + 60 * 16 // 512}
    assert set(m) == set(NULL_METRICS)


def test_run_metrics_without_queries_or_samples():
    m = run_metrics([_snap()], [_snap()], [])
    assert m["prefix_cache_hit_rate"] is None and m["max_num_running"] is None and m["mean_num_running"] is None
    assert m["kv_cache_utilization"] == {"mean": None, "max": None, "num_samples": 0}
    with pytest.raises(ValueError):
        run_metrics([_snap()], [_snap(), _snap()], [])


async def test_sampler_reads_before_during_and_after():
    reads = iter([[_snap(queried=10)]] + [[_snap(running=2, util=0.5)]] * 1000)

    async def read():
        return next(reads)

    async with StatsSampler(read, 0.001) as sampler:
        deadline = asyncio.get_running_loop().time() + 120  # only bounds a hang
        while len(sampler.samples) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.001)  # the sampler reads during the run
    assert sampler.before == [_snap(queried=10)] and sampler.after == [_snap(running=2, util=0.5)]
    assert sampler.samples and set(sampler.samples) == {Sample((0.5,), 2)}
    assert sampler.metrics()["prefix_cache_queried_tokens"] == -10


async def test_sampler_without_counters_gives_nulls():
    async def read():
        return None

    async with StatsSampler(read, 0.001) as sampler:
        await asyncio.sleep(0)  # a run: nothing to sample without counters
    assert sampler.metrics() == NULL_METRICS and not sampler.samples


# --- summary ------------------------------------------------------------------


def _report(target, conc, tok, ttft, workload="synthetic", caching=True, wait=0.0, **extra):
    report = {"target": target, "concurrency": conc, "dtype": "float32", "workload": workload,
              "output_tokens_per_s": tok, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft, "tpot_p50_s": 0.1, **extra}
    if target in ("engine", "mesh"):
        report["engine"] = {"enable_prefix_caching": caching, "max_batch_wait_ms": wait}
    return report


def test_summary_tables_hold_medians_and_ratios(tmp_path):
    reports = [_report("engine", 32, 40.0, 1.0), _report("engine", 32, 30.0, 1.0), _report("engine", 32, 38.0, 1.0),
               _report("hf-static", 32, 9.5, 3.0), _report("hf-continuous", 32, 19.0, 2.0),
               _report("engine", 8, 20.0, 4.0, workload="shared-prefix", prefix_cache_hit_rate=0.6),
               _report("engine", 8, 10.0, 8.0, workload="shared-prefix", caching=False, prefix_cache_hit_rate=0.0),
               _report("engine", 4, 12.0, 0.5), _report("engine", 4, 11.0, 0.6, wait=20.0),
               {"not": "a report"}]
    for i, r in enumerate(reports):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    text = summarise(tmp_path)
    assert "| engine | float32 | 32 | 3 | 38.0 | 1.000 | 2.000 | 0.100 | - |" in text
    assert "| hf-static | float32 | 32 | 1 | 9.5 | 3.000 | 6.000 | 0.100 | 4.00 |" in text
    assert "| hf-continuous | float32 | 32 | 1 | 19.0 | 2.000 | 4.000 | 0.100 | 2.00 |" in text
    assert "| engine | 8 | on | 1 | 20.0 | 4.000 | 8.000 | 60.0% |" in text
    assert "| engine | 8 | 2.00 | 2.00 | 2.00 |" in text  # TTFT off ÷ on, p99 off ÷ on, tokens/s on ÷ off
    assert "| engine | synthetic | 4 | 20 | 1 | 11.0 | 0.600 | 1.200 | 0.92 | 1.20 |" in text
    assert "| engine | synthetic | 4 | 0 | 1 | 12.0 | 0.500 | 1.000 | 1.00 | 1.00 |" in text


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
        _check_engine_fields(report, report["engine"]["num_blocks"], concurrency=2)
    else:
        assert all(report[k] is None for k in NULL_METRICS)


def _check_engine_fields(report, num_blocks, concurrency):
    """The engine figures of a real run: types, and the values a roomy cache implies."""
    kv, cap = report["kv_cache_utilization"], report["kv_capacity"]
    assert isinstance(kv["num_samples"], int)
    assert kv["num_samples"] == 0 or 0.0 < kv["mean"] <= kv["max"] <= 1.0
    assert report["num_preemptions"] == 0
    assert isinstance(report["prefix_cache_queried_tokens"], int) and report["prefix_cache_hit_tokens"] == 0
    assert report["prefix_cache_hit_rate"] in (0.0, None)  # uniform random prompts share no block
    assert cap["num_blocks"] == num_blocks and cap["block_size"] == 16 and cap["max_model_len"] > 0
    assert cap["requests_fit_reserved"] == num_blocks * 16 // cap["max_model_len"]
    assert cap["requests_fit_paged"] == report["max_num_running"]
    assert report["max_num_running"] is None or 1 <= report["max_num_running"] <= concurrency


def _shared_pair(prefix_len, user_len):
    """Two requests that share a ``prefix_len``-token system prompt, ``user_len`` user tokens each."""
    return WorkloadSpec(num_requests=2, seed=1, kind="shared-prefix", shared_prefix_len=prefix_len,
                        shared_fraction=1.0, prompt_len_median=user_len, prompt_len_range=(user_len, user_len),
                        output_len_median=3, output_len_range=(3, 3))


@pytest.mark.model
@pytest.mark.parametrize("block_size", [16, 8])
async def test_prefix_cache_hits_of_two_identical_prefix_requests(block_size, tokenizer):
    """One after the other (concurrency 1), the second request reuses every full block of
    the prefix the two share, capped so that its last prompt token is computed: hits =
    min(common // block_size, (len - 1) // block_size) * block_size tokens."""
    spec = _shared_pair(prefix_len=28, user_len=12)
    a, b = (r.prompt_token_ids for r in make_shared_prefix_workload(spec, tokenizer, 49152).requests)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 28 and len(a) == len(b) == 40
    hits = min(common // block_size, (len(b) - 1) // block_size) * block_size
    assert hits == {16: 16, 8: 24}[block_size]  # with this seed the user parts differ from their first token
    cfg = BenchConfig("engine", concurrency=1, workload=spec, warmup=1, dtype="float32", kv_cache_memory="64MiB",
                      block_size=block_size, stats_interval_s=0.01)
    report = await run_bench(cfg)
    assert (report["prefix_cache_queried_tokens"], report["prefix_cache_hit_tokens"]) == (80, hits)
    assert report["prefix_cache_hit_rate"] == hits / 80
    assert report["kv_capacity"]["block_size"] == block_size and report["num_preemptions"] == 0

    off = await run_bench(BenchConfig("engine", concurrency=1, workload=spec, warmup=0, dtype="float32",
                                      kv_cache_memory="64MiB", block_size=block_size, enable_prefix_caching=False))
    assert off["prefix_cache_hit_tokens"] == 0 and off["engine"]["enable_prefix_caching"] is False


@pytest.mark.model
async def test_a_cache_too_small_for_both_requests_preempts_once():
    """4 blocks of 16 tokens; two 24-token prompts take 2 blocks each; at its 33rd token
    the first needs a third block and the later arrival is preempted (recompute), then
    waits until the first is done: exactly one preemption."""
    spec = WorkloadSpec(num_requests=2, seed=0, prompt_len_median=24, prompt_len_range=(24, 24),
                        output_len_median=16, output_len_range=(16, 16))
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16  # layers * (K, V) * kv heads * head_dim * float32 * tokens
    cfg = BenchConfig("engine", concurrency=2, workload=spec, warmup=0, dtype="float32",
                      kv_cache_memory=str(4 * block_bytes), enable_prefix_caching=False, stats_interval_s=0.01)
    report = await run_bench(cfg)
    assert report["kv_capacity"]["num_blocks"] == 4
    assert report["num_preemptions"] == 1
    assert report["total_output_tokens"] == 32


@pytest.mark.model
@pytest.mark.parametrize("target", ["hf-static", "hf-continuous"])
async def test_tiny_transformers_batching_runs(target):
    spec = WorkloadSpec(num_requests=2, seed=0, prompt_len_median=16, prompt_len_range=(8, 32),
                        output_len_median=4, output_len_range=(4, 4))
    cfg = BenchConfig(target, concurrency=2, workload=spec, warmup=0, dtype="float32", kv_cache_memory="64MiB")
    report = await run_bench(cfg)
    assert [r["output_len"] for r in report["requests"]] == [4, 4] and report["total_output_tokens"] == 8
    assert (report["target"], report["concurrency"], report["dtype"]) == (target, 2, "float32")
    assert all(report[k] is None for k in NULL_METRICS) and "ttft_method" in report
    assert all(r["ttft_s"] > 0 for r in report["requests"])
    if target == "hf-continuous":
        hf = report["hf_continuous"]
        assert hf["num_blocks"] >= 1 and hf["max_batch_tokens"] == 2048 and hf["allow_block_sharing"] is True
    else:  # one static batch: both requests share its first-token time
        assert report["requests"][0]["ttft_s"] == report["requests"][1]["ttft_s"]


@pytest.mark.model
async def test_tiny_real_run_against_a_running_gateway(tokenizer, default_model_files):
    """The mesh target's client path (``--addr``) against an in-process mesh."""
    from executor.engine.config import CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from tests.support.mesh_harness import start_local_mesh
    from tests.support.tls import cert_dir

    cache = CacheConfig(kv_cache_memory_bytes=64 << 20)
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=1024, cache=cache))
    mesh = await start_local_mesh([engine], tokenizer)
    try:
        executor = mesh.executors[0][0].address
        cfg = BenchConfig("mesh", concurrency=3, workload=TINY, warmup=0, addr=mesh.gateway.address,
                          executor_addrs=(executor,), stats_interval_s=0.01, tls_dir=str(cert_dir()))
        report = await run_bench(cfg)
    finally:
        await mesh.stop()
    expected = make_workload(TINY, *model_vocabulary(default_model_files.path))
    assert REPORT_KEYS <= report.keys()
    assert report["total_output_tokens"] == sum(expected.output_lens)
    assert (report["addr"], report["concurrency"], report["dtype"]) == (mesh.gateway.address, 3, "auto")
    assert report["executor_addrs"] == [executor]
    _check_engine_fields(report, engine.num_blocks, concurrency=3)  # through the executor's Stats RPC
