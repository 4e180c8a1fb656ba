"""``meshserve bench`` as a sizing tool: the jsonl and multi-turn workloads, Poisson arrivals,
the open loop, parent-gated turns, sweeps, baselines, the report folder and its plots.
(About 500 lines: each sizing feature has a short test of exact values; split by feature
when it grows.)"""

import asyncio
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from meshserve.bench import BenchConfig, WorkloadSpec, run_bench
from meshserve.bench.arrivals import poisson_arrivals
from meshserve.bench.hf_targets import check_hf_workload
from meshserve.bench.jsonl_workload import WorkloadFileError, count_requests, load_jsonl_workload
from meshserve.bench.loop import checked_result, run_closed_loop, run_open_loop
from meshserve.bench.multi_turn import make_multi_turn_workload
from meshserve.bench.plots import LINE_STYLES, sweep_figures
from meshserve.bench.runner import main as bench_main
from meshserve.bench.sweep import (SweepPoint, check_baselines, parse_baselines, parse_values, point_seed, ratios,
                                   run_sweep, sweep_points)
from meshserve.bench.sweep_report import ratio_lines, write_report_dir
from meshserve.bench.workload import GREEDY, BenchRequest, Sampling
from meshserve.cli import app

PNG_HEADER = b"\x89PNG\r\n\x1a\n"


# --- jsonl --------------------------------------------------------------------


def _jsonl(tmp_path, *lines, name="w.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _jsonl_spec(path, n):
    return WorkloadSpec(num_requests=n, kind="jsonl", workload_file=path)


def test_jsonl_requests_carry_prompts_lengths_and_sampling(tmp_path, tokenizer):
    path = _jsonl(tmp_path, '{"prompt": "Hello there, library.", "max_tokens": 5}', "",
                  '{"prompt_token_ids": [504, 3, 1712], "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, '
                  '"top_k": 40, "min_p": 0.05, "seed": 11, "ignore_eos": false}',
                  '{"prompt_token_ids": [20], "max_tokens": 1}')
    assert count_requests(path) == 3
    wl = load_jsonl_workload(_jsonl_spec(path, 3), tokenizer, 49152)
    a, b, c = wl.requests
    assert [r.request_id for r in wl.requests] == ["bench-0", "bench-1", "bench-2"]
    assert a.prompt_token_ids == tuple(tokenizer.encode("Hello there, library.", add_special_tokens=False))
    assert (a.output_len, a.sampling, a.ignore_eos) == (5, GREEDY, True)
    assert b.prompt_token_ids == (504, 3, 1712) and b.output_len == 2 and b.ignore_eos is False
    assert b.sampling == Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11)
    assert c.prompt_token_ids == (20,)
    assert load_jsonl_workload(_jsonl_spec(path, 2), tokenizer, 49152).requests == (a, b)  # the first lines


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "max_tokens": 4', "not valid JSON"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"prompt": "x"}', "'max_tokens' is required"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be an integer >= 1, got 0"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens must be an integer >= 1, got True"),
    ('{"prompt": "x", "prompt_token_ids": [5], "max_tokens": 4}', "exactly one of 'prompt'"),
    ('{"max_tokens": 4}', "exactly one of 'prompt'"),
    ('{"prompt": "", "max_tokens": 4}', "'prompt' must be a non-empty string"),
    ('{"prompt_token_ids": [], "max_tokens": 4}', "'prompt_token_ids' must be a non-empty list"),
    ('{"prompt_token_ids": [5, -1], "max_tokens": 4}', "every prompt token id must be an integer >= 0, got -1"),
    ('{"prompt_token_ids": [49152], "max_tokens": 4}', "prompt token id 49152 is outside the model's vocabulary"),
    ('{"prompt": "x", "max_tokens": 4, "temperature": -1}', "temperature must lie in [0, inf], got -1"),
    ('{"prompt": "x", "max_tokens": 4, "top_p": 0}', "top_p must lie in (0, 1], got 0"),
    ('{"prompt": "x", "max_tokens": 4, "ignore_eos": "yes"}', "ignore_eos must be true or false"),
    ('{"prompt": "x", "max_tokens": 4, "stream": true}', "unknown field(s) stream (allowed: prompt,"),
])
def test_jsonl_errors_name_the_file_and_the_line(tmp_path, tokenizer, line, message):
    path = _jsonl(tmp_path, '{"prompt": "fine", "max_tokens": 3}', "", line)
    with pytest.raises(WorkloadFileError) as info:
        load_jsonl_workload(_jsonl_spec(path, 2), tokenizer, 49152)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_jsonl_file_too_short_or_missing(tmp_path, tokenizer):
    path = _jsonl(tmp_path, '{"prompt": "fine", "max_tokens": 3}')
    with pytest.raises(WorkloadFileError, match="holds 1 request\\(s\\); --num-requests asks for 2"):
        load_jsonl_workload(_jsonl_spec(path, 2), tokenizer, 49152)
    with pytest.raises(WorkloadFileError, match="cannot read the workload file"):
        load_jsonl_workload(_jsonl_spec(str(tmp_path / "none.jsonl"), 1), tokenizer, 49152)
    with pytest.raises(ValueError, match="needs --workload-file"):
        WorkloadSpec(num_requests=1, kind="jsonl")


def test_cli_reports_a_bad_workload_line_with_its_number(tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "fine", "max_tokens": 3}', '{"prompt": "x", "max_tokens": -2}')
    result = CliRunner().invoke(app, ["bench", "--workload", "jsonl", "--workload-file", path, "--quiet"])
    assert result.exit_code == 2
    assert f"{path}:2: max_tokens must be an integer >= 1, got -2" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--sweep-concurrency", "1,4", "--request-rate", "2"], "--sweep-concurrency runs the closed loop"),
    (["--sweep-concurrency", "1,x"], "expected comma-separated ints, got '1,x'"),
    (["--baseline", "sglang"], "--baseline must be one of hf-generate, hf-static, hf-continuous, vllm (each may add "
                               "@DTYPE; engine@DTYPE: the engine in another dtype), got 'sglang'"),
    (["--baseline", "hf-generate,engine"], "--baseline must be one of hf-generate, hf-static, hf-continuous, vllm"),
    (["--baseline", "vllm@int8"], "--baseline 'vllm@int8': the dtype must be one of auto, float32, bfloat16"),
    (["--baseline", "vllm"], "the vllm baseline needs --vllm-python PATH"),
    (["--baseline", "vllm", "--vllm-python", "/x/python", "--request-rate", "2"],
     "the vllm baseline runs the closed loop only"),
    (["--baseline", "hf-static", "--sweep-rate", "1,2"], "hf-static runs static batches and has no open loop"),
    (["--baseline", "hf-generate,hf-static", "--request-rate", "2"], "hf-static runs static batches and has no open"),
    (["--baseline", "hf-static,hf-continuous,hf-static"], "--baseline names hf-static more than once"),
    (["--workload", "jsonl"], "the jsonl workload needs --workload-file"),
])
def test_cli_refuses_bad_sweeps_and_baselines_in_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", "--quiet", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


# --- Poisson arrivals ---------------------------------------------------------


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    a = poisson_arrivals(20001, 4.0, seed=7)
    assert a == poisson_arrivals(20001, 4.0, seed=7)  # exactly reproducible
    assert a != poisson_arrivals(20001, 4.0, seed=8)
    gaps = np.diff(a)
    assert a[0] == 0.0 and len(a) == 20001 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: coefficient of variation 1
    # twice the rate: the same draws, half the gaps
    assert np.allclose(poisson_arrivals(100, 8.0, seed=7), np.array(poisson_arrivals(100, 4.0, seed=7)) / 2)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5
    assert poisson_arrivals(0, 2.0, seed=0) == []
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            poisson_arrivals(3, bad, seed=0)
    with pytest.raises(ValueError, match="request rate must be > 0"):
        BenchConfig("engine", 1, WorkloadSpec(num_requests=1), request_rate=0.0)
    with pytest.raises(ValueError, match="hf-static .* no open loop"):
        BenchConfig("hf-static", 1, WorkloadSpec(num_requests=1), request_rate=1.0)
    assert BenchConfig("engine", 4, WorkloadSpec(num_requests=1), request_rate=2.0).effective_concurrency is None


# --- loops with parents -------------------------------------------------------


def _turns(n_conv, n_turns):
    """Turn-major requests of ``n_conv`` conversations, each turn the parent of the next."""
    return [BenchRequest(f"bench-{c}-{t}", (20,), output_len=1, parent_id=f"bench-{c}-{t - 1}" if t else None)
            for t in range(n_turns) for c in range(n_conv)]


class _Recorder:
    def __init__(self):
        self.events, self.in_flight, self.peak = [], 0, 0

    async def send(self, req):
        self.events.append(("start", req.request_id))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.002)
        self.in_flight -= 1
        self.events.append(("end", req.request_id))
        return checked_result(req, 0.0, [1.0], 1.0)


@pytest.mark.parametrize("loop", ["closed", "open"])
async def test_a_turn_is_sent_only_after_its_parent_finished(loop):
    reqs, rec, seen = _turns(3, 3), _Recorder(), []
    if loop == "closed":
        results, _ = await run_closed_loop(reqs, 9, rec.send, seen.append)
    else:
        results, _ = await run_open_loop(reqs, [0.0] * 9, rec.send, seen.append)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert sorted(r.request_id for r in seen) == sorted(r.request_id for r in reqs)
    for req in reqs:
        if req.parent_id:
            assert rec.events.index(("end", req.parent_id)) < rec.events.index(("start", req.request_id))
    assert rec.peak == 3  # one turn per conversation at a time


async def test_open_loop_at_infinite_rate_has_every_request_in_flight():
    reqs, rec = [BenchRequest(f"bench-{i}", (20,), 1) for i in range(6)], _Recorder()
    results, wall = await run_open_loop(reqs, poisson_arrivals(6, math.inf, 0), rec.send)
    assert rec.peak == 6 and len(results) == 6 and wall > 0
    with pytest.raises(ValueError, match="2 arrival times for 6 requests"):
        await run_open_loop(reqs, [0.0, 0.0], rec.send)
    with pytest.raises(ValueError, match="parent request\\(s\\) bench-9 are not in the workload"):
        await run_closed_loop([BenchRequest("bench-0", (20,), 1, parent_id="bench-9")], 1, rec.send)


def test_checked_result_without_ignore_eos_accepts_an_early_stop():
    req = BenchRequest("r", (20,), output_len=4, ignore_eos=False)
    assert checked_result(req, 0.0, [1.0, 2.0], 2.0).output_len == 2
    with pytest.raises(Exception, match="1 to 4 tokens but received 5"):
        checked_result(req, 0.0, [1.0] * 5, 2.0)


# --- multi-turn ---------------------------------------------------------------


def _multi_spec(**kw):
    return WorkloadSpec(**{"num_requests": 8, "seed": 2, "kind": "multi-turn", "num_turns": 3,
                           "prompt_len_median": 12, "prompt_len_range": (4, 24), "output_len_median": 6,
                           "output_len_range": (2, 10), **kw})


def test_multi_turn_prompts_hold_the_previous_turn_its_answer_and_a_new_message(tokenizer):
    wl = make_multi_turn_workload(_multi_spec(), tokenizer, 49152)
    assert wl.requests == make_multi_turn_workload(_multi_spec(), tokenizer, 49152).requests  # seeded
    other = make_multi_turn_workload(_multi_spec(seed=3), tokenizer, 49152)
    assert [r.prompt_token_ids for r in other.requests] != [r.prompt_token_ids for r in wl.requests]
    # ceil(8 / 3) = 3 conversations, turn-major, cut to 8: conversation 2 lacks its third turn
    assert [r.request_id for r in wl.requests] == ["bench-0-0", "bench-1-0", "bench-2-0", "bench-0-1", "bench-1-1",
                                                   "bench-2-1", "bench-0-2", "bench-1-2"]
    by_id = {r.request_id: r for r in wl.requests}
    for r in wl.requests:
        if r.request_id.endswith("-0"):
            assert r.parent_id is None
            assert tokenizer.decode(r.prompt_token_ids).startswith("\nUser: ")
            continue
        parent = by_id[r.parent_id]
        assert r.parent_id == r.request_id[:-1] + str(int(r.request_id[-1]) - 1)
        n = len(parent.prompt_token_ids)
        assert r.prompt_token_ids[:n] == parent.prompt_token_ids  # the previous turn, exactly
        answer_and_message = tokenizer.decode(r.prompt_token_ids[n:])
        assert answer_and_message.startswith("\nAssistant: ") and "\nUser: " in answer_and_message
        openers = len(tokenizer.encode("\nAssistant: ")) + len(tokenizer.encode("\nUser: "))
        user_len = len(r.prompt_token_ids) - n - openers - parent.output_len  # the answer: output_len ids
        assert 4 <= user_len <= 24
    assert all(2 <= r.output_len <= 10 for r in wl.requests)


# --- sweep points, ratios, report folder --------------------------------------


def test_sweep_points_and_their_seeds():
    assert sweep_points(8, None) == [SweepPoint(8)]
    assert sweep_points(8, 2.0) == [SweepPoint(8, 2.0)]
    assert sweep_points(8, None, [1, 4, 16]) == [SweepPoint(1), SweepPoint(4), SweepPoint(16)]
    assert sweep_points(8, None, (), [0.5, math.inf]) == [SweepPoint(8, 0.5), SweepPoint(8, math.inf)]
    assert [p.label for p in sweep_points(8, None, (), [0.5, 2.0])] == ["r0.5", "r2"]
    for args in ((8, None, [1], [1.0]), (8, 1.0, [1, 2], ()), (8, None, [0, 2], ()), (8, None, [2, 2], ()),
                 (8, None, (), [0.0])):
        with pytest.raises(ValueError):
            sweep_points(*args)
    assert parse_values("1, 4,16", int) == [1, 4, 16] and parse_values("0.5,inf", float) == [0.5, math.inf]
    assert parse_values(None, int) == []
    with pytest.raises(ValueError, match="expected comma-separated ints, got '1,x'"):
        parse_values("1,x", int)
    assert point_seed(5, 0) == 5
    assert point_seed(5, 1) == point_seed(5, 1) != point_seed(5, 2) != 5


def test_ratios_are_target_over_baseline():
    t = {"output_tokens_per_s": 30.0, "ttft_p50_s": 0.5, "tpot_p50_s": 0.1}
    b = {"output_tokens_per_s": 10.0, "ttft_p50_s": 2.0, "tpot_p50_s": 0.0}
    assert ratios(t, b) == {"output_tokens_per_s": 3.0, "ttft_p50_s": 0.25, "tpot_p50_s": None}


def test_baselines_parse_in_order_and_are_checked_each():
    assert parse_baselines(None) == [] and parse_baselines("") == []
    assert parse_baselines("hf-continuous") == ["hf-continuous"]
    assert parse_baselines(" hf-static, hf-generate ,hf-continuous") == ["hf-static", "hf-generate", "hf-continuous"]
    with pytest.raises(ValueError, match="got 'hf-fast'"):
        parse_baselines("hf-generate,hf-fast")
    with pytest.raises(ValueError, match="names hf-generate more than once"):
        parse_baselines("hf-generate,hf-continuous,hf-generate")
    check_baselines(["hf-generate", "hf-continuous"], open_loop=True)
    check_baselines(["hf-static"], open_loop=False)
    with pytest.raises(ValueError, match="hf-static runs static batches and has no open loop"):
        check_baselines(["hf-generate", "hf-static"], open_loop=True)


def test_a_baseline_may_name_its_dtype_and_vllm_runs_in_the_named_python(tmp_path):
    from pathlib import Path

    from meshserve.bench.sweep import _baseline_config
    from meshserve.bench.vllm_target import RUNNER, VLLMTarget

    assert parse_baselines("vllm,vllm@bfloat16,engine@bfloat16") == ["vllm", "vllm@bfloat16", "engine@bfloat16"]
    with pytest.raises(ValueError, match="got 'engine'"):
        parse_baselines("engine")  # the engine in the run's own dtype is the target itself
    with pytest.raises(ValueError, match="names vllm@float32 more than once"):
        parse_baselines("vllm@float32,vllm@float32")
    with pytest.raises(ValueError, match="the vllm baseline runs the closed loop only"):
        check_baselines(["vllm@bfloat16"], open_loop=True)
    run = BenchConfig("engine", 8, WorkloadSpec(num_requests=1), dtype="float32", kv_cache_memory="1536MiB",
                      num_threads=1, vllm_python="/opt/v/bin/python", enable_prefix_caching=False,
                      long_prefill_token_threshold=128)
    cfg = _baseline_config(run, "vllm@bfloat16")
    assert (cfg.target, cfg.dtype, cfg.vllm_python) == ("vllm", "bfloat16", "/opt/v/bin/python")
    assert _baseline_config(run, "vllm").dtype == "float32"
    assert _baseline_config(run, "engine@bfloat16").target == "engine"
    assert VLLMTarget(cfg, Path("/models/m")).command() == [
        "/opt/v/bin/python", "-I", str(RUNNER), "--model", "/models/m", "--dtype", "bfloat16", "--threads", "1",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--long-prefill-token-threshold", "128",
        "--kv-cache-gib", "2", "--no-prefix-caching"]
    with pytest.raises(ValueError, match="needs --vllm-python"):
        BenchConfig("vllm", 1, WorkloadSpec(num_requests=1))


def test_the_vllm_runner_imports_nothing_of_meshserve():
    """It runs in vLLM's environment, which need not have meshserve's dependencies."""
    import ast

    from meshserve.bench.vllm_target import RUNNER

    tree = ast.parse(RUNNER.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert imported == {"__future__", "argparse", "json", "os", "sys", "time", "vllm"}
    assert 'if __name__ == "__main__":' in RUNNER.read_text()


def _vllm_runner():
    """The vLLM runner script as a module (it imports vllm only inside ``main()``)."""
    import importlib.util

    from meshserve.bench.vllm_target import RUNNER

    spec = importlib.util.spec_from_file_location("vllm_runner_under_test", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner


def test_the_vllm_runner_binds_its_threads_to_the_cores_the_bench_may_use():
    """``taskset -c 1 meshserve bench ...`` runs vLLM's OpenMP thread on core 1 too, not on core 0."""
    import os

    runner = _vllm_runner()
    cores = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, {cores[-1]})
        assert runner.omp_threads_bind(1) == str(cores[-1])
        assert runner.omp_threads_bind(4) == str(cores[-1])  # never a core outside the mask
    finally:
        os.sched_setaffinity(0, set(cores))
    assert runner.omp_threads_bind(len(cores)) == ",".join(map(str, cores))


def test_the_vllm_runner_adds_a_request_sent_while_others_run_after_the_next_step():
    """As an asynchronous engine takes it (ours behind the engine target, vLLM's behind its
    server): the step that ends a request is followed at once by the next, so the request a
    closed-loop client sends then joins the step after it; requests sent to an idle engine
    join its first step."""
    from types import SimpleNamespace

    runner = _vllm_runner()

    class Engine:  # one token a step for each request in it
        def __init__(self):
            self.steps, self.joined, self.running = 0, {}, {}

        def add_request(self, request_id, prompt, params):
            self.joined[request_id] = self.steps
            self.running[request_id] = (params, [])

        def step(self):
            outputs = []
            for request_id, (n, tokens) in list(self.running.items()):
                tokens.append(7)
                finished = len(tokens) == n
                outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                               outputs=[SimpleNamespace(token_ids=list(tokens))]))
                if finished:
                    del self.running[request_id]
            self.steps += 1
            return outputs

    engine = Engine()
    requests = [{"id": f"r{i}", "prompt_token_ids": [1, 2], "output_len": n} for i, n in enumerate([2, 3, 1, 1])]
    got = runner.run_closed_loop(engine, requests, 2, sampling_params=lambda n: n)
    # r0 and r1 join the idle engine's first step (0); r0 ends in step 1, so r2, sent then, joins step 3;
    # r1 ends in step 2, when r2 waits to run step 3: r3, sent then, joins step 4
    assert engine.joined == {"r0": 0, "r1": 0, "r2": 3, "r3": 4}
    assert [len(r["token_times"]) for r in got["results"]] == [2, 3, 1, 1]
    r2 = got["results"][2]
    assert r2["submit"] <= r2["token_times"][0] and engine.steps == 5


def test_hf_targets_refuse_sampled_requests_and_static_open_loop():
    sampled = [BenchRequest("bench-3", (20,), 4, Sampling(temperature=0.7))]
    with pytest.raises(ValueError, match="hf-continuous runs greedy requests with ignore_eos only; bench-3 asks "
                                         "temperature 0.7"):
        check_hf_workload("hf-continuous", sampled, open_loop=False)
    with pytest.raises(ValueError, match="ignore_eos false"):
        check_hf_workload("hf-generate", [BenchRequest("b", (20,), 4, ignore_eos=False)], open_loop=True)
    with pytest.raises(ValueError, match="no open loop"):
        check_hf_workload("hf-static", [BenchRequest("b", (20,), 4)], open_loop=True)
    check_hf_workload("hf-generate", [BenchRequest("b", (20,), 4)], open_loop=True)


def _run_report(target, rate, conc, scale):
    requests = [{"request_id": f"bench-{i}", "prompt_len": 10, "output_len": 1 + i % 3, "ttft_s": scale * (i + 1),
                 "tpot_s": scale / 10 * (i + 1), "e2e_s": scale * (i + 2)} for i in range(5)]
    return {"target": target, "dtype": "float32", "num_requests": 5, "output_tokens_per_s": 10.0 / scale,
            "requests_per_s": 1.0 / scale, "ttft_p50_s": 3 * scale, "ttft_p99_s": 5 * scale,
            "tpot_p50_s": 0.3 * scale, "tpot_p99_s": 0.5 * scale, "e2e_p50_s": 4 * scale, "e2e_p99_s": 6 * scale,
            "prompt_len_median": 10, "output_len_median": 2, "warmup": 0, "request_rate": rate, "concurrency": conc,
            "engine": {"num_threads": 1}, "requests": requests}


def test_report_folder_of_an_open_loop_sweep_holds_json_summary_and_plots(tmp_path):
    points = []
    for i, rate in enumerate([0.5, 2.0, "inf"]):
        t, b = _run_report("engine", rate, None, 1.0 + i), _run_report("hf-generate", rate, None, 4.0 + i)
        points.append({"point": i, "concurrency": None, "request_rate": rate, "seed": i, "target": t,
                       "baselines": {"hf-generate": b}, "ratios": {"hf-generate": ratios(t, b)},
                       "load_average_1m": 1.5 + i})
    doc = {"target": "engine", "baselines": ["hf-generate"], "model": "default", "workload": "synthetic",
           "sweep": {"over": "request_rate", "values": [0.5, 2.0, "inf"]}, "points": points}
    files = write_report_dir(doc, tmp_path / "rep", command="meshserve bench --sweep-rate 0.5,2,inf")
    names = [f.relative_to(tmp_path / "rep").as_posix() for f in files]
    assert names == ["report.json", "summary.md", "plots/throughput_vs_rate.png", "plots/ttft_cdf.png",
                     "plots/tpot_cdf.png", "plots/latency_vs_load.png"]
    for png in files[2:]:
        data = png.read_bytes()
        assert data.startswith(PNG_HEADER) and len(data) > 5000
    assert json.loads(files[0].read_text()) == doc
    md = files[1].read_text()
    assert md.startswith("# meshserve bench: engine vs hf-generate\n")
    assert "meshserve bench --sweep-rate 0.5,2,inf" in md
    assert "### Ratios to the baseline\n" in md
    assert "| 0.5 req/s | engine | 5 | 10.0 | 1.00 | 3000.0 | 5000.0 | 300.0 | 500.0 | 4.00 | 6.00 |" in md
    assert "| all at once | hf-generate | 5 | 1.7 | 0.17 | 18000.0 |" in md
    assert "| 0.5 req/s | 4.00 | 0.25 | 0.25 |" in md  # (10/1)/(10/4), 3/12, 0.3/1.2
    assert "![ttft_cdf](plots/ttft_cdf.png)" in md
    assert "median tokens per point: 10 / 2, 10 / 2, 10 / 2" in md
    assert "load average after each point: 1.50, 2.50, 3.50." in md


THREE = ("hf-generate", "hf-static", "hf-continuous")


def _closed_doc(baselines):
    """A closed-loop sweep at concurrency 1 and 4: the engine at scale 1 + i, baseline k at 2 * (k + 1) + i."""
    points = []
    for i, conc in enumerate([1, 4]):
        t = _run_report("engine", None, conc, 1.0 + i)
        bs = {name: _run_report(name, None, conc, 2.0 * (k + 1) + i) for k, name in enumerate(baselines)}
        points.append({"point": i, "concurrency": conc, "request_rate": None, "seed": i, "target": t,
                       "baselines": bs, "ratios": {n: ratios(t, b) for n, b in bs.items()}, "load_average_1m": 0.5})
    return {"target": "engine", "baselines": list(baselines), "model": "default", "workload": "synthetic",
            "sweep": {"over": "concurrency", "values": [1, 4]}, "points": points}


def test_report_folder_with_three_baselines_has_a_row_a_ratio_table_and_a_line_for_each(tmp_path):
    doc = _closed_doc(THREE)
    files = write_report_dir(doc, tmp_path, command="meshserve bench --baseline hf-generate,hf-static,hf-continuous")
    assert json.loads(files[0].read_text())["baselines"] == list(THREE)
    md = files[1].read_text()
    assert md.startswith("# meshserve bench: engine vs hf-generate, hf-static, hf-continuous\n")
    rows = [line for line in md.splitlines() if line.startswith("| concurrency ")]
    systems_rows = [r for r in rows if r.count("|") == 12]
    assert [r.split(" | ")[:2] for r in systems_rows] == [["| concurrency 1", n] for n in ("engine", *THREE)] + \
        [["| concurrency 4", n] for n in ("engine", *THREE)]
    assert systems_rows[2] == ("| concurrency 1 | hf-static | 5 | 2.5 | 0.25 | 12000.0 | 20000.0 | 1200.0 | 2000.0 "
                               "| 16.00 | 24.00 |")
    assert "### Ratios to the baselines\n" in md and "one table per baseline." in md
    # engine at point i has scale 1 + i, baseline k 2(k + 1) + i: tokens/s ratio = b/t, TTFT/TPOT ratio = t/b
    expected = []
    for k, name in enumerate(THREE):
        expected += ([""] if k else []) + [
            f"| load | tokens/s engine ÷ {name} | TTFT p50 engine ÷ {name} | TPOT p50 engine ÷ {name} |",
            "|---|---|---|---|",
            *(f"| concurrency {c} | {(2 * (k + 1) + i) / (1 + i):.2f} | {(1 + i) / (2 * (k + 1) + i):.2f} | "
              f"{(1 + i) / (2 * (k + 1) + i):.2f} |" for i, c in enumerate([1, 4]))]
    assert ratio_lines(doc) == expected
    assert "\n".join(expected) in md
    assert "| concurrency 4 | 2.50 | 0.40 | 0.40 |" in expected  # hf-generate at point 1: 5 / 2


def test_a_baseline_of_the_target_in_another_dtype_is_named_by_its_baseline_name(tmp_path):
    """The four-way matrix's rows (run 79's summary had engine, engine, vllm, vllm)."""
    doc = _closed_doc(["engine@float32", "vllm@bfloat16"])
    for point in doc["points"]:
        point["baselines"]["engine@float32"]["target"] = "engine"
        point["baselines"]["vllm@bfloat16"]["target"] = "vllm"
    md = write_report_dir(doc, tmp_path)[1].read_text()
    rows = [line.split(" | ")[:2] for line in md.splitlines() if line.startswith("| concurrency 1 |")
            and line.count("|") == 12]
    assert rows == [["| concurrency 1", n] for n in ("engine", "engine@float32", "vllm@bfloat16")]


def test_report_folder_without_a_baseline_has_the_target_rows_only(tmp_path):
    doc = _closed_doc([])
    files = write_report_dir(doc, tmp_path)
    md = files[1].read_text()
    assert md.startswith("# meshserve bench: engine\n") and "Ratios" not in md and ratio_lines(doc) == []
    assert [line.split(" | ")[:2] for line in md.splitlines() if line.startswith("| concurrency ")] == [
        ["| concurrency 1", "engine"], ["| concurrency 4", "engine"]]
    assert len(files) == 6


def test_every_plot_has_a_line_per_system():
    doc = _closed_doc(THREE)
    figs = sweep_figures(doc)
    assert list(figs) == ["throughput_vs_concurrency.png", "ttft_cdf.png", "tpot_cdf.png", "latency_vs_load.png"]
    names = ["engine", *THREE]
    labels = {f: fig.axes[0].get_legend_handles_labels()[1] for f, fig in figs.items()}
    assert labels["throughput_vs_concurrency.png"] == names
    assert labels["latency_vs_load.png"] == [f"{n} {q}" for n in names for q in ("p50", "p99")]
    for cdf in ("ttft_cdf.png", "tpot_cdf.png"):
        assert labels[cdf] == [f"{n} c{c}" for c in (1, 4) for n in names]
        assert [line.get_linestyle() for line in figs[cdf].axes[0].get_lines()] == list(LINE_STYLES) * 2
    throughput = figs["throughput_vs_concurrency.png"].axes[0].get_lines()
    assert [list(line.get_ydata()) for line in throughput] == [
        [10.0, 5.0], [5.0, 10.0 / 3], [2.5, 2.0], [10.0 / 6, 10.0 / 7]]
    assert len({line.get_color() for line in throughput}) == 4
    single = sweep_figures(_closed_doc(["hf-continuous"]))
    assert single["throughput_vs_concurrency.png"].axes[0].get_legend_handles_labels()[1] == ["engine", "hf-continuous"]
    none = sweep_figures(_closed_doc([]))
    assert none["latency_vs_load.png"].axes[0].get_legend_handles_labels()[1] == ["engine p50", "engine p99"]
    import matplotlib.pyplot as plt

    plt.close("all")


# --- real runs on the default model -------------------------------------------


TINY = dict(prompt_len_median=24, prompt_len_range=(16, 40), output_len_median=4, output_len_range=(3, 6))


@pytest.mark.model
async def test_sweep_with_a_baseline_writes_every_point_and_the_ratios(tmp_path):
    spec = WorkloadSpec(num_requests=3, seed=0, **TINY)
    cfg = BenchConfig("engine", 1, spec, warmup=1, dtype="float32", kv_cache_memory="64MiB", stats_interval_s=0.01)
    doc = await run_sweep(cfg, sweep_points(1, None, [1, 2]), baselines=["hf-continuous"])
    assert doc["sweep"] == {"over": "concurrency", "values": [1, 2]} and doc["baselines"] == ["hf-continuous"]
    assert [p["concurrency"] for p in doc["points"]] == [1, 2]
    assert [p["seed"] for p in doc["points"]] == [0, point_seed(0, 1)]
    for p in doc["points"]:
        assert list(p["baselines"]) == list(p["ratios"]) == ["hf-continuous"]
        t, b = p["target"], p["baselines"]["hf-continuous"]
        assert (t["target"], b["target"]) == ("engine", "hf-continuous")
        assert t["concurrency"] == b["concurrency"] == p["concurrency"]
        assert t["num_requests"] == b["num_requests"] == 3
        assert [r["output_len"] for r in t["requests"]] == [r["output_len"] for r in b["requests"]]
        assert t["total_prompt_tokens"] == b["total_prompt_tokens"]  # the same requests
        assert set(p["ratios"]["hf-continuous"]) == {"output_tokens_per_s", "ttft_p50_s", "tpot_p50_s"}
        assert isinstance(p["load_average_1m"], float)
        assert p["ratios"]["hf-continuous"]["output_tokens_per_s"] == \
            t["output_tokens_per_s"] / b["output_tokens_per_s"]
    assert doc["points"][0]["target"]["total_prompt_tokens"] != doc["points"][1]["target"]["total_prompt_tokens"]
    files = write_report_dir(doc, tmp_path)
    assert len(json.loads((tmp_path / "report.json").read_text())["points"]) == 2
    assert "| concurrency 2 | engine | 3 |" in (tmp_path / "summary.md").read_text()
    assert "tokens/s engine ÷ hf-continuous" in (tmp_path / "summary.md").read_text()
    assert all(f.read_bytes().startswith(PNG_HEADER) for f in files[2:]) and len(files) == 6


@pytest.mark.model
async def test_the_engine_target_freezes_the_start_up_heap_while_it_serves():
    """As the executor's CLI, and as vLLM's engine core in-process (``freeze_gc_heap`` at
    start-up, ``gc.unfreeze`` at shutdown): the cyclic collector skips the start-up heap."""
    import gc

    from meshserve.bench.targets import EngineTarget
    from meshserve.model_files import resolve_model

    cfg = BenchConfig("engine", 1, WorkloadSpec(num_requests=1, seed=0, **TINY), warmup=0, dtype="float32",
                      kv_cache_memory="64MiB")
    target = EngineTarget(cfg, resolve_model("default").path)
    await target.start()
    try:
        assert gc.get_freeze_count() > 100_000  # the model's modules, torch's and the tokenizer's objects
    finally:
        await target.stop()
    assert gc.get_freeze_count() == 0


@pytest.mark.model
async def test_multi_turn_on_the_engine_reuses_each_previous_prompt(tokenizer):
    """2 conversations of 2 turns at concurrency 2: each second turn is sent after its
    first, whose prompt blocks are then cached, so it hits every full block of it."""
    spec = WorkloadSpec(num_requests=4, seed=1, kind="multi-turn", num_turns=2, **TINY)
    wl = make_multi_turn_workload(spec, tokenizer, 49152)
    firsts = [r for r in wl.requests if r.parent_id is None]
    hits = sum(len(r.prompt_token_ids) // 16 * 16 for r in firsts)
    assert hits > 0
    cfg = BenchConfig("engine", 2, spec, warmup=0, dtype="float32", kv_cache_memory="64MiB", stats_interval_s=0.01)
    report = await run_bench(cfg)
    assert report["workload"] == "multi-turn" and report["num_requests"] == 4
    assert report["prefix_cache_queried_tokens"] == sum(len(r.prompt_token_ids) for r in wl.requests)
    assert report["prefix_cache_hit_tokens"] == hits


@pytest.mark.model
async def test_jsonl_with_sampling_in_the_open_loop_on_the_engine(tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "The library opens at nine.", "max_tokens": 4}',
                  '{"prompt_token_ids": [504, 3, 1712, 77, 901], "max_tokens": 3, "temperature": 0.8, "seed": 3}',
                  '{"prompt": "Say one word.", "max_tokens": 6, "ignore_eos": false, "top_k": 5, "temperature": 1.0}')
    spec = WorkloadSpec(num_requests=3, kind="jsonl", workload_file=path)
    cfg = BenchConfig("engine", 1, spec, warmup=0, dtype="float32", kv_cache_memory="64MiB",
                      request_rate=math.inf)
    report = await run_bench(cfg)
    assert (report["mode"], report["request_rate"], report["concurrency"]) == ("open-loop", "inf", None)
    lens = [r["output_len"] for r in report["requests"]]
    assert lens[:2] == [4, 3] and 1 <= lens[2] <= 6
    assert report["total_output_tokens"] == sum(lens)


@pytest.mark.model
def test_bench_with_three_baselines_prints_writes_and_plots_each(tmp_path, capsys):
    """``meshserve bench``'s runner with ``--baseline hf-generate,hf-static,hf-continuous`` at
    concurrency 1 and 2: every baseline runs the target's requests at every point, and has its
    rows, its ratio table and its line."""
    spec = WorkloadSpec(num_requests=3, seed=0, **TINY)
    cfg = BenchConfig("engine", 1, spec, warmup=0, dtype="float32", kv_cache_memory="64MiB", stats_interval_s=0.01)
    assert bench_main(cfg, None, sweep_points(1, None, [1, 2]), list(THREE), str(tmp_path), quiet=True) == 0
    out = capsys.readouterr().out
    systems = [line.split()[1] for line in out.splitlines() if line.startswith("target ") and "workload)" in line]
    assert systems == ["engine", *THREE] * 2
    assert out.count("target ÷ baseline (tokens/s above 1") == 1
    for name in THREE:
        assert out.count(f"| load | tokens/s engine ÷ {name} | TTFT p50 engine ÷ {name} |") == 1
    assert out.count("| concurrency 1 | ") == 3 and out.count("| concurrency 2 | ") == 3  # a ratio row per baseline
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["baselines"] == list(THREE) and len(doc["points"]) == 2
    for p in doc["points"]:
        assert list(p["baselines"]) == list(p["ratios"]) == list(THREE)
        t = p["target"]
        for name in THREE:
            b = p["baselines"][name]
            conc = 1 if name == "hf-generate" else p["concurrency"]  # hf-generate serves one request at a time
            assert (b["target"], b["num_requests"], b["concurrency"]) == (name, 3, conc)
            assert [r["output_len"] for r in b["requests"]] == [r["output_len"] for r in t["requests"]]
            assert b["total_prompt_tokens"] == t["total_prompt_tokens"]  # the same requests
            assert p["ratios"][name]["output_tokens_per_s"] == t["output_tokens_per_s"] / b["output_tokens_per_s"]
    md = (tmp_path / "summary.md").read_text()
    assert [line.split(" | ")[1] for line in md.splitlines() if line.startswith("| concurrency 2 | ")
            and line.count("|") == 12] == ["engine", *THREE]
    assert md.count("| load | tokens/s engine ÷ ") == 3
    assert sorted(f.name for f in (tmp_path / "plots").iterdir()) == [
        "latency_vs_load.png", "throughput_vs_concurrency.png", "tpot_cdf.png", "ttft_cdf.png"]
