"""Decode steps padded to a batch-size bucket and replayed from CUDA graphs
(``executor.worker.cuda_graphs``).

Here on CPU: the buckets and the padded host arrays (pure functions); the padded
static-buffer pass (``CUDAGraphRunner(capture=False)``: the code a graph replays,
run eagerly) against the unpadded eager step, through whole greedy generations of
a tiny random Llama, exactly (tokens, logprobs, hidden states); the Triton
backend's data-independent decode plan in that pass (Triton's interpreter on CPU,
natively with CUDA); the CUDA engine test's workload through the padded pass (torch
backend), which runs every bucket. With CUDA (``tests/gpu_check.sh``): the engine with
graphs on gives the token ids of graphs off, and its replay counters show which buckets ran.

Imports only torch, numpy, pytest, triton, transformers, ``executor`` and
``meshserve.sampling`` (so ``tests/gpu_check.sh`` runs it with ``--noconftest`` on an
image without the CLI's dependencies: the ``--cuda-graphs`` flag's test is in
``tests/meshserve/cli/test_cuda_graphs_flag.py``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA and not _TRITON_IMPORTED_EARLY:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported (see test_triton_attention.py)

from executor.attention.backend import AttentionBackend  # noqa: E402
from executor.engine.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from executor.worker.cuda_graphs import (CUDAGraphRunner, graph_batch_sizes, graphs_off_reason,  # noqa: E402
                                         pad_decode_batch, pick_bucket)
from meshserve.sampling import SamplingParams  # noqa: E402

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run by tests/gpu_check.sh)")


# --------------------------------------------------------------------------- pure functions


def test_buckets_are_vllms_sizes_up_to_the_first_holding_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(300)[-5:] == [248, 256, 272, 288, 304]  # multiples of 16 from 256
    assert graph_batch_sizes(4096)[-1] == 512          # the cap: larger batches run eagerly
    assert graph_batch_sizes(64, limit=20) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_pick_bucket_is_the_smallest_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24, 25)] == [1, 2, 4, 4, 8, 8, 16, 24, 24, None]


def test_padded_batch_rows_write_and_read_only_the_padding_block():
    b = pad_decode_batch(token_ids=[11, 12, 13], num_computed_tokens=[20, 3, 16],
                         block_ids=[[5, 7], [2], [9, 4]], block_size=16, bucket=8, max_blocks=4, padding_block=30)
    assert (b.bucket, b.num_reqs) == (8, 3)
    assert b.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert b.positions.tolist() == [20, 3, 16, 0, 0, 0, 0, 0]
    assert b.slot_mapping.tolist() == [7 * 16 + 4, 2 * 16 + 3, 4 * 16 + 0] + [30 * 16] * 5
    assert b.seq_lens.tolist() == [21, 4, 17, 1, 1, 1, 1, 1]
    assert b.block_table.tolist() == [[5, 7, 0, 0], [2, 0, 0, 0], [9, 4, 0, 0]] + [[30, 0, 0, 0]] * 5
    assert (b.input_ids.dtype, b.slot_mapping.dtype, b.seq_lens.dtype, b.block_table.dtype) == (
        np.int64, np.int64, np.int32, np.int32)


def test_padding_refuses_batches_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit a bucket"):
        pad_decode_batch([1, 2], [0, 0], [[0], [1]], 16, bucket=1, max_blocks=2, padding_block=9)
    with pytest.raises(ValueError, match="exceed the table"):
        pad_decode_batch([1], [40], [[0, 1, 2]], 16, bucket=1, max_blocks=2, padding_block=9)
    with pytest.raises(ValueError, match="cannot hold position 16"):
        pad_decode_batch([1], [16], [[0]], 16, bucket=1, max_blocks=2, padding_block=9)


class _PlansPerStep(AttentionBackend):
    name = "per-step"

    def forward(self, q, k, v, kv_cache, metadata, scale):  # pragma: no cover - never run
        raise AssertionError


class _PlansStatically(_PlansPerStep):
    name = "static"
    supports_cuda_graphs = True


def test_graphs_run_only_on_one_cuda_device_with_a_static_plan():
    static, per_step = _PlansStatically(), _PlansPerStep()
    assert graphs_off_reason(None, "cuda", static, 1) is None
    assert graphs_off_reason(True, "cuda", static, 1) is None
    assert graphs_off_reason(False, "cuda", static, 1) == "turned off (--no-cuda-graphs)"
    assert graphs_off_reason(True, "cpu", static, 1) == "not on a cpu device"
    assert "plans each step" in graphs_off_reason(None, "cuda", per_step, 1)
    assert graphs_off_reason(None, "cuda", static, 2) == "not with tensor or pipeline parallelism"


def test_capture_is_refused_where_a_graph_cannot_replay():
    with pytest.raises(ValueError, match="CUDA graphs need"):
        CUDAGraphRunner(torch.nn.Identity(), _PlansStatically(), [1, 2], 16, 64, padding_block=4, device="cpu")


# --------------------------------------------------------------------------- the padded pass, on a model

NUM_BLOCKS = 40
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256


@pytest.fixture
def one_thread():
    """torch on one thread (the CPU decode kernel's path), put back after the test (here,
    not in conftest.py: ``tests/gpu_check.sh`` runs this module with ``--noconftest``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.support.parallel import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


def _runner(path, backend: str, device: str, padded: bool, partition_size: int | None = None):
    """A ModelRunner over a fresh cache of ``NUM_BLOCKS`` + 1 blocks (the last one the
    padding block), with the padded pass (no capture) when ``padded``."""
    from executor.model_loader import load_model
    from executor.worker.kv_cache import allocate_kv_storage, layer_views
    from executor.worker.model_runner import ModelRunner

    loaded = load_model(path, dtype="float32", max_model_len=MAX_MODEL_LEN, attention_backend=backend, device=device)
    layers = loaded.model.attention_layers()
    if partition_size is not None:
        layers[0].backend.partition_size = partition_size
    storage = allocate_kv_storage(len(layers), NUM_BLOCKS + 1, BLOCK_SIZE, layers[0].num_kv_heads,
                                  layers[0].head_dim, loaded.dtype, device)
    for layer, kv in zip(layers, layer_views(storage)):
        layer.kv_cache = kv
    graphs = CUDAGraphRunner(loaded.model, layers[0].backend, graph_batch_sizes(8), BLOCK_SIZE, MAX_MODEL_LEN,
                             padding_block=NUM_BLOCKS, device=device, capture=False) if padded else None
    return ModelRunner(loaded, BLOCK_SIZE, device=device, graphs=graphs)


def _generate(runner, prompts: list[list[int]], max_tokens: list[int]):
    """Greedy generation driven step by step: every prompt prefilled in the first step,
    then decode steps of the still-running requests (the batch shrinks as they end).
    Returns each request's tokens and each decode step's sampled logprobs."""
    per = NUM_BLOCKS // len(prompts)  # request i owns blocks i * per .. i * per + per - 1
    assert all(len(p) + n <= per * BLOCK_SIZE for p, n in zip(prompts, max_tokens))
    seqs = [list(p) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logprobs = []
    params = SamplingParams(max_tokens=max(max_tokens), temperature=0.0, ignore_eos=True, logprobs=3)
    step = [(i, list(p), 0) for i, p in enumerate(prompts)]   # (request, new tokens, computed)
    while step:
        scheduled = []
        for i, new, computed in step:
            need = -(-(computed + len(new)) // BLOCK_SIZE)
            blocks = list(range(i * per, i * per + need))
            scheduled.append(ScheduledRequest(str(i), new, computed, blocks, params, True, seqs[i], len(prompts[i])))
        result = runner.execute_model(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
        if all(len(s.token_ids) == 1 for s in scheduled):
            logprobs.append({rid: (lp.token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs)
                             for rid, lp in result.logprobs.items()})
        step = []
        for i in range(len(prompts)):
            if str(i) in result.sampled_token_ids:
                token = result.sampled_token_ids[str(i)]
                out[i].append(token)
                seqs[i].append(token)
                if len(out[i]) < max_tokens[i]:
                    step.append((i, [token], len(seqs[i]) - 1))
    return out, logprobs


PROMPT_LENGTHS = (1, 5, 16, 17, 30, 44, 50)
MAX_TOKENS = [24, 3, 20, 8, 12, 16, 5]  # the decode batch shrinks 7 → 1: buckets 8, 4, 2 and 1


def _prompts(vocab: int = 515) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_padded_decode_pass_gives_the_real_rows_exactly_the_unpadded_steps_results(tiny_llama, one_thread):
    """The torch backend on CPU: tokens and top-3 logprobs of every decode step equal."""
    eager = _generate(_runner(tiny_llama, "torch", "cpu", padded=False), _prompts(), MAX_TOKENS)
    runner = _runner(tiny_llama, "torch", "cpu", padded=True)
    padded = _generate(runner, _prompts(), MAX_TOKENS)
    assert padded[0] == eager[0]
    assert padded[1] == eager[1]
    assert [len(t) for t in padded[0].values()] == MAX_TOKENS
    assert {b: n > 0 for b, n in runner.graphs.replays.items()} == {1: True, 2: True, 4: True, 8: True}
    assert runner.graphs.num_replays == max(MAX_TOKENS) - 1  # every decode step ran padded


def test_padded_pass_hidden_states_of_real_rows_equal_the_unpadded_forward(tiny_llama, one_thread):
    """One decode step of 5 requests (bucket 8): the real rows' final hidden states and
    logits are bitwise those of the unpadded batch; the padded rows wrote only the
    padding block."""
    runner = _runner(tiny_llama, "torch", "cpu", padded=True)
    prompts = _prompts()[2:]
    _generate(runner, prompts, [1] * len(prompts))  # prefill: the cache holds the prompts
    per = NUM_BLOCKS // len(prompts)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    scheduled = [ScheduledRequest(str(i), [7 + i], len(p), list(range(i * per, i * per + len(p) // BLOCK_SIZE + 1)),
                                  params, True, p + [7 + i], len(p)) for i, p in enumerate(prompts)]
    scheduled.sort(key=lambda s: -s.num_computed_tokens)  # the runner's decode order
    layer0 = runner.model.attention_layers()[0]
    padding_before = layer0.kv_cache[0][NUM_BLOCKS].clone()
    with torch.inference_mode():
        ids, pos, md = runner._prepare_inputs(scheduled)
        runner.attention_backend.plan(md)
        want = runner.model(ids, pos, md).clone()
        batch = runner.graphs.pad(scheduled)
        assert (batch.bucket, batch.num_reqs) == (8, 5)
        got = runner.graphs.run(batch)
        assert torch.equal(got, want)
        assert torch.equal(runner.model.compute_logits(got), runner.model.compute_logits(want))
    assert not torch.equal(layer0.kv_cache[0][NUM_BLOCKS], padding_before)  # the padded rows' K
    assert torch.equal(layer0.kv_cache[0][NUM_BLOCKS][1:], padding_before[1:])  # slot 0 only


def test_mixed_and_prefill_steps_run_eagerly(tiny_llama):
    runner = _runner(tiny_llama, "torch", "cpu", padded=True)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    decode = ScheduledRequest("d", [5], 3, [0], params, True, [1, 2, 3, 5], 3)
    prefill = ScheduledRequest("p", [1, 2], 0, [1], params, True, [1, 2], 2)
    assert runner.graphs.pad([decode, prefill]) is None
    assert runner.graphs.pad([prefill]) is None
    assert runner.graphs.pad([]) is None
    assert runner.graphs.pad([decode] * 9) is None                     # above the largest bucket (8)
    long = ScheduledRequest("l", [5], MAX_MODEL_LEN, list(range(17)), params, True, [], 0)
    assert runner.graphs.pad([long]) is None                           # past the static plan's length
    assert runner.graphs.pad([decode]).bucket == 1


def _assert_logprobs_close(got: list[dict], want: list[dict]) -> None:
    """Each decode step's sampled and top token ids equal, their logprobs within 1e-4."""
    assert [sorted(step) for step in got] == [sorted(step) for step in want]
    for got_step, want_step in zip(got, want):
        for rid, (token, logprob, top_ids, top_logprobs) in got_step.items():
            want_token, want_logprob, want_top_ids, want_top_logprobs = want_step[rid]
            assert (token, top_ids) == (want_token, want_top_ids)
            assert logprob == pytest.approx(want_logprob, abs=1e-4)
            assert top_logprobs == pytest.approx(want_top_logprobs, abs=1e-4)


@pytest.mark.skipif(_TRITON_IMPORTED_EARLY and not CUDA,
                    reason="triton was imported before TRITON_INTERPRET=1 could be set; run this module on its own")
def test_triton_static_decode_plan_gives_the_dynamic_plans_tokens_and_logprobs(tiny_llama):
    """The Triton backend (interpreter on CPU): the padded pass with the bucket's static
    plan (grid for max_model_len = 16 partitions of 16 tokens), made once and never
    updated from the host, against the per-step plan of the unpadded batch (as many
    partitions as the longest context needs): the same tokens and logprobs (with CUDA,
    the logprobs within 1e-4: cuBLAS may pick another kernel for a padded batch's GEMMs)."""
    pytest.importorskip("triton")
    if not CUDA:
        from tests.support.triton_interpreter import patch_for_numpy_2_4

        patch_for_numpy_2_4()
    device = "cuda" if CUDA else "cpu"
    prompts, max_tokens = _prompts()[:5], [6, 3, 5, 2, 4]
    eager = _generate(_runner(tiny_llama, "triton", device, padded=False, partition_size=16), prompts, max_tokens)
    runner = _runner(tiny_llama, "triton", device, padded=True, partition_size=16)
    plan = runner.graphs.metadata[8].plan
    assert (plan.decode_partitions, plan.decode_max_seq_len) == (MAX_MODEL_LEN // 16, MAX_MODEL_LEN)
    padded = _generate(runner, prompts, max_tokens)
    if CUDA:  # cuBLAS may round a row of the padded (larger) batch's GEMMs differently in the last bits
        assert padded[0] == eager[0]
        _assert_logprobs_close(padded[1], eager[1])
    else:
        assert padded == eager
    assert runner.graphs.num_replays == max(max_tokens) - 1
    # the forward read no per-step host value: the bucket's host lists are still the padding's
    assert runner.graphs.metadata[8].seq_lens_cpu == [1] * 8 and runner.graphs.metadata[8].plan is plan


@pytest.mark.parametrize("requested,logged", [(True, True), (None, False), (False, False)])
def test_cuda_graphs_on_cpu_are_ignored_with_a_log_line(tiny_llama, caplog, requested, logged):
    """Asked for on a CPU, graphs are off with one log line (silent when not asked for),
    and the cache has exactly the engine's blocks (no padding block)."""
    import logging

    from executor.engine.config import CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    caplog.set_level(logging.INFO, logger="executor.worker.worker")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", cuda_graphs=requested,
                                    cache=CacheConfig(num_blocks=12)))
    worker = engine.worker_group.worker
    assert worker.model_runner.graphs is None
    assert worker.kv_caches[0][0].shape[0] == 12
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert lines == (["CUDA graphs off: not on a cpu device; every step runs eagerly"] if logged else [])


# --------------------------------------------------------------------------- the engine, graphs on and off


def _save_llama(path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.15, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


ENGINE_PROMPT_LENGTHS = (1, 7, 15, 16, 17, 40, 90, 130, 300, 520, 700)
ENGINE_BUCKETS = [1, 2, 4, 8, 16]


def _engine_max_tokens(i: int) -> int:
    """Request ``i``'s tokens: all 11 requests still decode in the first steps after the
    last prefill chunk (step 10), so pure-decode steps of 11 requests (bucket 16) run,
    then fewer as they end (buckets 8, 4, 2, 1)."""
    return 12 + 3 * i


def _engine_tokens(path, device: str, backend: str, graphs: bool):
    """Greedy float32 generation of the engine workload (chunked prefill, then decode
    batches shrinking from 11 requests to 1): each request's token ids, and the engine."""
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in ENGINE_PROMPT_LENGTHS]
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype="float32", attention_backend=backend,
                                    cuda_graphs=graphs, cache=CacheConfig(block_size=16, num_blocks=512),
                                    batch=BatchSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=_engine_max_tokens(i), temperature=0.0,
                                                          ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()
    assert engine.stats().num_free_blocks == 512
    return tokens, engine


def _check_engine_results(results: dict, engines: dict) -> None:
    """Graphs on and off gave the same tokens, every bucket ran, the padding block is
    the cache's one block more."""
    assert engines[False].worker_group.worker.model_runner.graphs is None
    assert engines[False].worker_group.worker.kv_caches[0][0].shape[0] == 512
    assert engines[True].worker_group.worker.kv_caches[0][0].shape[0] == 513
    graphs = engines[True].worker_group.worker.model_runner.graphs
    assert graphs is not None, "graph capture failed: see the log's warning"
    assert sorted(graphs.replays) == ENGINE_BUCKETS
    assert all(graphs.replays[b] > 0 for b in ENGINE_BUCKETS), graphs.replays
    assert [len(results[True][str(i)]) for i in range(len(ENGINE_PROMPT_LENGTHS))] == [
        _engine_max_tokens(i) for i in range(len(ENGINE_PROMPT_LENGTHS))]
    assert results[True] == results[False]


def test_engine_workload_runs_every_bucket_through_the_padded_pass(tmp_path, monkeypatch):
    """The CUDA test's workload on the CPU (torch backend), the padded pass forced on
    without capture: every bucket of 1..16 runs, and the tokens are graphs off's (so the
    CUDA test's bucket and token checks hold for its workload)."""
    import functools

    from executor.worker import worker

    monkeypatch.setattr(worker, "graphs_off_reason", lambda requested, *_: "off" if requested is False else None)
    monkeypatch.setattr(worker, "CUDAGraphRunner", functools.partial(CUDAGraphRunner, capture=False))
    _save_llama(tmp_path)
    results, engines = {}, {}
    for graphs in (True, False):
        results[graphs], engines[graphs] = _engine_tokens(tmp_path, "cpu", "torch", graphs)
    _check_engine_results(results, engines)


@requires_cuda
@pytest.mark.gpu
def test_engine_with_cuda_graphs_generates_the_tokens_of_eager_decode(tmp_path):
    """Greedy float32 through the whole engine (chunked prefill, then decode batches
    shrinking from 11 requests to 1: buckets 16, 8, 4, 2, 1) with graphs on and off:
    identical token ids, the graphs replayed in every one of those buckets, and the
    blocks all back. (float32 only: cuBLAS may round a padded batch's rows differently,
    which this model's logit gaps absorb in float32, as test_cuda_engine's do.)"""
    _save_llama(tmp_path)
    results, engines = {}, {}
    for graphs in (True, False):
        results[graphs], engines[graphs] = _engine_tokens(tmp_path, "cuda", "triton", graphs)
    _check_engine_results(results, engines)
    assert sorted(engines[True].worker_group.worker.model_runner.graphs.graphs) == ENGINE_BUCKETS  # captured
