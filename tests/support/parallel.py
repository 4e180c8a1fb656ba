"""Helpers of the tensor-parallel tests: tiny random transformers models on disk
(and S of the behaviour cases), engine configs with chunked prefill, prefix
caching and preemption on, the workload that exercises all three, a step loop
that keeps each request's logprobs, and the cases' REF equality at TP > 1."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig, ParallelConfig
from executor.engine.outputs import TokenLogprob
from meshserve.sampling import SamplingParams

TINY = dict(vocab_size=515, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=256, initializer_range=0.15, eos_token_id=2)
"""A tiny Llama-family shape (the odd vocabulary pads the vocab-parallel shards)."""


def save_tiny(path: Path, kind: str = "llama", num_kv_heads: int = 2) -> Path:
    """Saves a random-init tiny ``kind`` (``llama`` or ``qwen2``) model with
    ``num_kv_heads`` KV heads under ``path``; biases random so they matter."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = Qwen2Config if kind == "qwen2" else LlamaConfig
    config = cls(**TINY, num_key_value_heads=num_kv_heads, tie_word_embeddings=kind == "llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def parallel_config(model: str, tensor_parallel_size: int = 1, num_blocks: int = 14,
                    max_num_batched_tokens: int = 32, max_model_len: int | None = None,
                    pipeline_parallel_size: int = 1, step_log_dir: str | None = None) -> EngineConfig:
    """A float32 engine of ``model`` over ``tensor_parallel_size`` × ``pipeline_parallel_size``
    ranks: chunked prefill
    (prompts longer than ``max_num_batched_tokens``), prefix caching, and a cache of
    ``num_blocks`` blocks of 16 tokens, small enough that ``WORKLOAD`` preempts; each
    rank's step log in ``step_log_dir`` (None: none)."""
    return EngineConfig(model=model, dtype="float32", max_model_len=max_model_len,
                        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True),
                        batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                                   enable_chunked_prefill=True),
                        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                pipeline_parallel_size=pipeline_parallel_size, rank_timeout_s=300,
                                                step_log_dir=step_log_dir))


def workload(vocab_size: int, max_tokens: int = 12, seed: int = 1) -> tuple[list[list[int]], SamplingParams]:
    """Five prompts: two share a 40-token prefix (prefix cache hits), three are longer
    than one step's budget (chunked prefill); greedy, ``max_tokens`` each."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab_size, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (3, 9)]
    prompts += [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (1, 37, 70)]
    return prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


SMALL = dict(vocab_size=49152, hidden_size=320, intermediate_size=640, num_hidden_layers=4, num_attention_heads=10,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, initializer_range=0.15,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
"""S of the behaviour cases: a Llama with the default model's tokenizer and vocabulary,
one KV head (replicated at TP > 1) and a vocabulary that 5 ranks split with 3 padding rows."""

SMALL_KV_BYTES_PER_BLOCK = 4 * 2 * 1 * 16 * 32 * 4
"""S's KV bytes per block: layers × K,V × total KV heads × block 16 × head_dim × float32."""


def save_small(path: Path, tokenizer_dir: Path) -> Path:
    """Saves S with fixed-seed random weights (``initializer_range`` 0.15, so greedy
    choices are clear-cut) and the tokenizer files of ``tokenizer_dir`` under ``path``."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


@dataclass
class Finished:
    """One request's whole result from ``run_requests``."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    num_kvstore_tokens: int = 0
    finish_reason: str | None = None


def run_requests(engine, requests: dict[str, tuple[list[int], SamplingParams]],
                 before_step=None) -> dict[str, Finished]:
    """Adds every request, steps the engine until none is left, returns each one's
    tokens, logprobs and prompt logprobs. ``before_step(engine, results, step)`` runs
    before each step (to add or abort requests mid-run: it may add to ``requests``)."""
    import time

    results: dict[str, Finished] = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
        results[request_id] = Finished()
    step = 0
    while True:
        if before_step is not None:
            before_step(engine, results, step)
        if not engine.has_unfinished_requests():
            return results
        outputs = engine.step()
        if engine.last_step_was_empty:
            time.sleep(0.001)  # a kvstore fetch in flight
        step += 1
        for out in outputs:
            r = results[out.request_id]
            r.token_ids += out.new_token_ids
            r.logprobs += out.logprobs or []
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            r.num_kvstore_tokens = r.num_kvstore_tokens or out.num_kvstore_tokens
            if out.finished:
                r.finish_reason = out.finish_reason


def assert_ref_equal(ref: list[TokenLogprob], got: list[TokenLogprob], tolerance: float = 1e-3) -> int:
    """REF equality at TP > 1 (the cases' definition): the token ids equal REF's up to
    the first position where REF's top-2 logprob margin is below 1e-4, and the chosen
    tokens' logprobs are within ``tolerance`` up to there. ``ref`` needs logprobs >= 2.

    Returns:
        The positions compared (all of them unless a near-tie stopped the comparison).
    """
    assert len(got) == len(ref)
    for i, (r, g) in enumerate(zip(ref, got)):
        if r.top_logprobs[0] - r.top_logprobs[1] < 1e-4:
            return i
        assert g.token_id == r.token_id, f"position {i}: {g.token_id} != REF {r.token_id}"
        assert abs(g.logprob - r.logprob) <= tolerance, f"position {i}: logprob {g.logprob} vs REF {r.logprob}"
    return len(ref)


@dataclass
class RoundTrip:
    """What ``kvstore_round_trip`` saw: the writer's and the reader's results, the
    size of every block the kvstore was asked to store, and the fingerprint (block
    metadata) of every Put."""

    written: Finished
    read: Finished
    blocks_stored: int
    put_sizes: list[int]
    put_fingerprints: list


def kvstore_round_trip(writer, reader, prompt: list[int], params: SamplingParams) -> RoundTrip:
    """Runs ``prompt`` on ``writer`` (which publishes its blocks to a fresh kvstore),
    then on ``reader`` (which fetches them), both with their prefix caches emptied
    first; the connectors are removed after."""
    from executor.kvstore_connector import KVStoreConnector
    from tests.support.served_kvstore import RecordingServicer, RecordingStore, ServedKVStore

    served = ServedKVStore(RecordingStore(memory_bytes=64 << 20), servicer_cls=RecordingServicer)
    engines, connectors = (writer, reader), []
    try:
        for engine in engines:
            engine.reset_prefix_cache()
            connector = KVStoreConnector(served.address, engine.kv_store_fingerprint, fetch_timeout_s=120)
            engine.set_kv_connector(connector)
            connectors.append(connector)
        written = run_requests(writer, {"kv-write": (prompt, params)})["kv-write"]
        connectors[0].flush()
        read = run_requests(reader, {"kv-read": (prompt, params)})["kv-read"]
        return RoundTrip(written, read, served.stats().blocks_stored, list(served.store.put_sizes),
                         list(served.service.servicer.put_fingerprints))
    finally:
        for engine, connector in zip(engines, connectors):
            engine.set_kv_connector(None)
            connector.close()
        served.stop()
