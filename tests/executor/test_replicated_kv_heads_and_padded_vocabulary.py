"""S (4 layers, 10 query heads, one KV head, the default model's 49,152-token
vocabulary) at tensor-parallel 5 against one rank, on gloo: its one KV head is
replicated on 5 ranks and its vocabulary split with 3 padding rows (cases C32
(b), (c) and C33). One TP=5 group and one single-rank engine serve the whole module."""

from __future__ import annotations

import logging

import pytest
import torch

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig, ParallelConfig
from executor.engine.llm_engine import LLMEngine
from executor.models.embedding import VocabParallelEmbedding
from executor.models.parallel import TensorParallel
from meshserve.sampling import SamplingParams
from tests.support.parallel import SMALL_KV_BYTES_PER_BLOCK, assert_ref_equal, kvstore_round_trip, run_requests

pytestmark = pytest.mark.model

VOCAB = 49152
LAST_ID = VOCAB - 1


def small_config(path, tensor_parallel_size: int) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", max_model_len=1024,
                        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=True),
                        batch=BatchSchedulerConfig(max_num_seqs=24, max_num_batched_tokens=512),
                        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, rank_timeout_s=300))


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def single(small_model):
    return LLMEngine(small_config(small_model, 1))


@pytest.fixture(scope="module")
def tp5(small_model):
    """S over 5 ranks, with the lines its start-up logged."""
    handler, logger = _Lines(), logging.getLogger("executor.worker.worker")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        engine = LLMEngine(small_config(small_model, 5))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    engine.startup_log = handler.lines
    yield engine
    engine.shutdown()


def _prompts(tokenizer, n: int, words: int) -> list[list[int]]:
    return [tokenizer(" ".join(f"item {i}.{j} of a long list about rivers and towns" for j in range(words)),
                      add_special_tokens=False)["input_ids"] for i in range(n)]


def test_startup_logs_the_padded_vocabulary_size(tp5):
    """Case C33: startup logs the padded vocabulary size (49,152 → 49,155 over 5 ranks)."""
    assert ("vocabulary of 49152 tokens padded to 49155 for 5 tensor-parallel ranks: 9831 rows per rank, "
            "3 padding rows on the last") in tp5.startup_log


def test_the_last_token_embedding_comes_from_the_last_shard(small_model):
    """Case C33: id 49151's embedding row is held by rank 4 of 5 only, at its local row
    49151 - 4 × 9831, equal to the checkpoint's row; the 3 padding rows after it are 0."""
    from safetensors.torch import load_file

    whole = load_file(small_model / "model.safetensors")["model.embed_tokens.weight"]
    shards = []
    for rank in range(5):
        emb = VocabParallelEmbedding(VOCAB, 320, TensorParallel(rank, 5))
        emb.weight_loader(emb.weight, whole)
        shards.append(emb)
    holders = [e for e in shards if e.vocab_start <= LAST_ID < e.vocab_start + e.rows_per_rank]
    assert [e.tp.rank for e in holders] == [4]
    last = holders[0]
    assert (last.vocab_start, last.rows_per_rank) == (4 * 9831, 9831)
    assert torch.equal(last.weight[LAST_ID - last.vocab_start], whole[LAST_ID])
    assert torch.count_nonzero(last.weight[LAST_ID - last.vocab_start + 1:]) == 0
    assert last.weight.shape[0] - (LAST_ID - last.vocab_start + 1) == 3


def test_greedy_tokens_and_logprobs_equal_one_rank(single, tp5, tokenizer):
    """Cases C32 (b) and C33: S at TP=5 (its one KV head on all 5 ranks, 3 vocabulary
    padding rows) against TP=1: greedy, max_tokens 64, 8 prompts, one of them holding
    id 49151 and asking for prompt logprobs (top 20): REF equality (token ids,
    chosen-token logprobs within 1e-3) at every position, prompt logprobs within 1e-3
    (the entry after 49151 is computed from its embedding), no id >= 49152 anywhere."""
    prompts = _prompts(tokenizer, 8, 3)
    prompts[3] = prompts[3] + [LAST_ID] + prompts[3][:5]  # 49151 inside the prompt
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    with_prompt = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    requests = {f"g{i}": (p, with_prompt if i == 3 else greedy) for i, p in enumerate(prompts)}
    ref = run_requests(single, requests)
    got = run_requests(tp5, requests)
    compared = [assert_ref_equal(ref[rid].logprobs, got[rid].logprobs) for rid in requests]
    assert compared == [64] * 8  # no near-tie cut a comparison short: every position was checked
    ref_prompt, got_prompt = ref["g3"].prompt_logprobs, got["g3"].prompt_logprobs
    assert [p.token_id for p in got_prompt] == prompts[3][1:]
    position = prompts[3].index(LAST_ID)  # the entry of the token after 49151 is computed from its embedding
    assert got_prompt[position].token_id == prompts[3][position + 1]
    for r, g in zip(ref_prompt, got_prompt):
        assert abs(r.logprob - g.logprob) <= 1e-3
        assert len(g.top_token_ids) == 20 and max(g.top_token_ids) < VOCAB
    for result in got.values():
        assert max(result.token_ids) < VOCAB
        assert all(max(lp.top_token_ids) < VOCAB for lp in result.logprobs)


def test_sampled_tokens_never_reach_the_padding_rows(tp5, tokenizer):
    """Case C33, smaller: 500 tokens (the case: 2,000) sampled at temperature 1.5 over 20
    requests with top_logprobs 20 on every step and prompt logprobs (top 20): no sampled
    id, no id among the top 20 and none among the prompt logprobs is >= 49152 (the
    padding rows). 25 tokens per request test the same property: every step samples
    from the full gathered vocabulary (a TP=5 step costs about 0.5 s on 2 cores)."""
    prompts = _prompts(tokenizer, 20, 1)
    params = SamplingParams(max_tokens=25, temperature=1.5, seed=7, ignore_eos=True, logprobs=20,
                            prompt_logprobs=20)
    got = run_requests(tp5, {f"s{i}": (p, params) for i, p in enumerate(prompts)})
    sampled = [t for r in got.values() for t in r.token_ids]
    assert len(sampled) == 500
    assert max(sampled) < VOCAB
    tops = [lp.top_token_ids for r in got.values() for lp in r.logprobs + r.prompt_logprobs]
    assert len(tops) == 500 + sum(len(p) - 1 for p in prompts) and all(len(t) == 20 for t in tops)
    assert max(max(t) for t in tops) < VOCAB
    assert tp5.stats().num_free_blocks == tp5.stats().num_blocks


@pytest.mark.parametrize("writer_tp,reader_tp", [(5, 1), (1, 5)], ids=["tp5-writes-tp1-reads", "tp1-writes-tp5-reads"])
def test_kvstore_blocks_round_trip_between_tp5_and_one_rank(single, tp5, tokenizer, writer_tp, reader_tp):
    """Case C32 (c) on S: a 300-token prompt (temperature 0, max_tokens 32) saves its
    blocks to the kvstore from one layout and another layout loads them: the reader
    reports kvstore_tokens > 0 and its output equals S's cold REF (REF equality); every
    stored block holds exactly 16,384 bytes whatever the writer's TP, and every Put's
    block metadata names S's total of 1 KV head (tensor-parallel size 1: whole blocks)."""
    engines = {1: single, 5: tp5}
    prompt = _prompts(tokenizer, 1, 40)[0][:300]
    assert len(prompt) == 300
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    single.reset_prefix_cache()
    cold = run_requests(single, {"cold": (prompt, params)})["cold"]
    trip = kvstore_round_trip(engines[writer_tp], engines[reader_tp], prompt, params)
    assert trip.written.num_kvstore_tokens == 0
    assert trip.blocks_stored == 20  # 18 prompt blocks, 2 filled while decoding (331 tokens)
    assert set(trip.put_sizes) == {SMALL_KV_BYTES_PER_BLOCK} and len(trip.put_sizes) >= 20  # the reader puts too
    assert {(fp.layout.num_kv_heads, fp.layout.tp_size, fp.layout.block_bytes)
            for fp in trip.put_fingerprints} == {(1, 1, SMALL_KV_BYTES_PER_BLOCK)}
    assert trip.read.num_kvstore_tokens == 18 * 16
    assert assert_ref_equal(cold.logprobs, trip.read.logprobs) == 32
    assert assert_ref_equal(cold.logprobs, trip.written.logprobs) == 32
