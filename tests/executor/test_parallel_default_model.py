"""The default model (9 query heads, 3 KV heads, 30 layers) over 3 tensor-parallel
ranks and over 2 pipeline stages, on gloo: greedy tokens equal to the single-rank
engine's with chunked prefill, prefix caching and preemption at work; KV blocks
saved by the group are the whole-model blocks (the single rank's, within float
noise) and a block loaded into the group comes back byte for byte; blocks go
through a kvstore between the group and one rank both ways (case C32 (c)); every
rank logs the same micro-batches in the same order while requests arrive, are
cancelled and preempted (case C34)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.engine.llm_engine import LLMEngine
from executor.engine.scheduler_output import BlockSave, SchedulerOutput
from executor.worker.step_log import read_step_logs
from meshserve.sampling import SamplingParams
from tests.support.parallel import (Finished, assert_ref_equal, kvstore_round_trip, parallel_config, run_requests,
                                    workload)

pytestmark = pytest.mark.model

VOCAB = 49152


@pytest.fixture(scope="module")
def single(default_model_files):
    engine = LLMEngine(parallel_config("default", max_model_len=512))
    prompts, params = workload(VOCAB, max_tokens=10)  # enough to preempt in either prefill order
    outputs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0  # the workload exercises both
    return engine, outputs


@pytest.fixture(scope="module", params=[(3, 1), (1, 2)], ids=["tp3", "pp2"])
def group(request, default_model_files, tmp_path_factory):
    """The default model at TP=3 or PP=2; every rank's step log under ``engine.step_log_dir``."""
    tp, pp = request.param
    step_log_dir = tmp_path_factory.mktemp(f"steps-tp{tp}-pp{pp}")
    engine = LLMEngine(parallel_config("default", tp, max_model_len=512, pipeline_parallel_size=pp,
                                       step_log_dir=str(step_log_dir)))
    engine.step_log_dir = step_log_dir
    yield engine
    engine.shutdown()


def _saves(block_ids: list[int]) -> SchedulerOutput:
    return SchedulerOutput([], 0, kv_saves=[BlockSave(b, b, "probe") for b in block_ids])


def test_group_generates_the_single_rank_tokens(single, group):
    _, expected = single
    prompts, params = workload(VOCAB, max_tokens=10)  # enough to preempt in either prefill order
    assert group.generate(prompts, params) == expected
    s, g = single[0].stats(), group.stats()
    assert (g.num_preemptions, g.prefix_cache_hit_tokens) == (s.num_preemptions, s.prefix_cache_hit_tokens)
    assert g.num_free_blocks == g.num_blocks == s.num_blocks  # the group's capacity is the engine's


def test_saved_blocks_are_whole_model_blocks_and_loads_round_trip(single, group):
    """Run after the generation above: both caches hold the same prompts in the same blocks."""
    assert group.kv_store_fingerprint == single[0].kv_store_fingerprint  # one namespace for every layout
    ours = group.worker_group.execute_model(_saves([0, 1])).kv_saved
    reference = single[0].worker_group.execute_model(_saves([0, 1])).kv_saved
    assert [len(p) for p in ours] == [len(p) for p in reference] == [group.kv_layout.block_bytes] * 2
    for got, want in zip(ours, reference):
        np.testing.assert_allclose(np.frombuffer(got, np.float32), np.frombuffer(want, np.float32), atol=1e-3)
    free = group.num_blocks - 1  # no request holds it now: a scratch block
    step = SchedulerOutput([], 0, kv_loads=[(free, reference[0])], kv_saves=[BlockSave(free, free, "probe")])
    assert group.worker_group.execute_model(step).kv_saved == [reference[0]]


M_KV_BYTES_PER_BLOCK = 30 * 2 * 3 * 16 * 64 * 4  # 737,280: layers × K,V × total KV heads × block × head_dim × fp32


@pytest.fixture(scope="module")
def one_rank(default_model_files):
    """A second single-rank engine for the tests below, which leave its cache and counters
    changed (``single`` must stay as the workload left it for the tests above at PP=2)."""
    return LLMEngine(parallel_config("default", max_model_len=512))


def test_kvstore_blocks_round_trip_between_tp3_and_one_rank(one_rank, group):
    """Case C32 (c) on the default model, smaller: a 150-token prompt (the case: 300; the
    group's pool is 14 blocks), temperature 0, max_tokens 16 (the case: 32), written to a
    kvstore at TP=3 and loaded at TP=1, then the reverse: the reader reports
    kvstore_tokens > 0 and its output equals the cold REF (REF equality); every block put
    is exactly 737,280 bytes whatever the writer's layout, and every Put's block
    metadata names the model's 3 KV heads in total (tensor-parallel size 1: whole blocks).
    Run at TP=3 only (the PP=2 group is the case's TP=1 layout in this respect)."""
    if group.config.parallel.tensor_parallel_size != 3:
        pytest.skip("case C32 (c) is TP=3 against TP=1")
    prompt = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    one_rank.reset_prefix_cache()
    cold = run_requests(one_rank, {"cold": (prompt, params)})["cold"]
    for writer, reader in ((group, one_rank), (one_rank, group)):
        trip = kvstore_round_trip(writer, reader, prompt, params)
        assert trip.blocks_stored == 10  # 9 prompt blocks, 1 filled while decoding (165 tokens)
        assert set(trip.put_sizes) == {M_KV_BYTES_PER_BLOCK} and len(trip.put_sizes) >= 10  # the reader puts too
        assert {(fp.layout.num_kv_heads, fp.layout.tp_size, fp.layout.block_bytes)
                for fp in trip.put_fingerprints} == {(3, 1, M_KV_BYTES_PER_BLOCK)}
        assert (trip.written.num_kvstore_tokens, trip.read.num_kvstore_tokens) == (0, 9 * 16)
        assert assert_ref_equal(cold.logprobs, trip.written.logprobs) == 16
        assert assert_ref_equal(cold.logprobs, trip.read.logprobs) == 16


PROMPT_LENS = (5, 150, 23, 96, 60, 131, 12, 77)  # requests 0-3 at the start, then one every 3 steps
CANCELLED = {"c34-2": 3, "c34-5": 2}  # request -> tokens it has when it is cancelled (mid-decode)
MAX_TOKENS = 16


def _c34_requests() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(34)
    return {f"c34-{i}": torch.randint(3, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)}


def test_ranks_log_the_same_micro_batches_while_requests_arrive_cancel_and_preempt(one_rank, group):
    """Case C34, smaller: the default model at PP=2 (2 micro-batches in flight) and at
    TP=3, a 14-block pool (224 tokens): 8 requests of 5-150 tokens (the case: 24 of
    5-600), 4 at the start and one every 3 steps after, temperature 0, max_tokens 16
    (the case: 64), 2 cancelled mid-decode (the case: 4), the pool forcing preemptions.
    Every rank's step log (step id, ordered request ids, token counts per micro-batch) is
    the same list, step for step; at PP=2 steps with 2 micro-batches occur; the logged
    token counts add up to the tokens the engine ran; every completed request equals its
    REF (the one-rank engine's greedy output, REF equality); the cancellations and the
    preemptions shift no other request's tokens; all KV blocks are free at the end."""
    requests = _c34_requests()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    completed = [rid for rid in requests if rid not in CANCELLED]
    ref = run_requests(one_rank, {rid: (requests[rid], params) for rid in completed})
    first_step = group.worker_group.num_steps
    forward_tokens, preemptions = group.num_forward_tokens, group.stats().num_preemptions
    pending = list(requests)[4:]

    def arrive_and_cancel(engine, results, step):
        if step and step % 3 == 0 and pending:
            rid = pending.pop(0)
            engine.add_request(rid, requests[rid], params)
            results[rid] = Finished()
        for rid, at in CANCELLED.items():
            if rid in results and len(results[rid].token_ids) >= at and results[rid].finish_reason is None:
                assert engine.abort_request(rid)
                results[rid].finish_reason = "cancelled"

    got = run_requests(group, {rid: (requests[rid], params) for rid in list(requests)[:4]}, arrive_and_cancel)
    assert pending == [] and set(got) == set(requests)
    for rid in completed:
        assert got[rid].finish_reason == "length"
        assert assert_ref_equal(ref[rid].logprobs, got[rid].logprobs) == MAX_TOKENS
    for rid, at in CANCELLED.items():
        assert got[rid].finish_reason == "cancelled" and len(got[rid].token_ids) == at
    stats = group.stats()
    assert stats.num_preemptions > preemptions
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting, stats.num_blocks_by_request) == (
        stats.num_blocks, 0, 0, ())

    logs = read_step_logs(group.step_log_dir)
    world = group.config.parallel.world_size
    assert sorted(logs) == list(range(world))
    steps = {rank: [r for r in records if r["step"] > first_step] for rank, records in logs.items()}
    reference = [(r["step"], r["micro_batches"]) for r in steps[0]]
    for rank in range(1, world):
        assert [(r["step"], r["micro_batches"]) for r in steps[rank]] == reference
    assert [r["stage"] for r in steps[world - 1]] == [world - 1 if group.config.parallel.pipeline_parallel_size > 1
                                                     else 0] * len(reference)
    assert sum(n for _, mbs in reference for mb in mbs for _, n in mb) == group.num_forward_tokens - forward_tokens
    assert {rid for _, mbs in reference for mb in mbs for rid, _ in mb} == set(requests)
    if group.config.parallel.pipeline_parallel_size == 2:
        assert any(len(mbs) == 2 for _, mbs in reference)
