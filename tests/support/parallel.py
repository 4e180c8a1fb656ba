"""Helpers of the tensor-parallel tests: tiny random transformers models on disk,
engine configs with chunked prefill, prefix caching and preemption on, and the
workload that exercises all three."""

from __future__ import annotations

from pathlib import Path

import torch

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig, ParallelConfig
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
                    pipeline_parallel_size: int = 1) -> EngineConfig:
    """A float32 engine of ``model`` over ``tensor_parallel_size`` × ``pipeline_parallel_size``
    ranks: chunked prefill
    (prompts longer than ``max_num_batched_tokens``), prefix caching, and a cache of
    ``num_blocks`` blocks of 16 tokens, small enough that ``WORKLOAD`` preempts."""
    return EngineConfig(model=model, dtype="float32", max_model_len=max_model_len,
                        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True),
                        batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                                   enable_chunked_prefill=True),
                        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                pipeline_parallel_size=pipeline_parallel_size, rank_timeout_s=300))


def workload(vocab_size: int, max_tokens: int = 12, seed: int = 1) -> tuple[list[list[int]], SamplingParams]:
    """Five prompts: two share a 40-token prefix (prefix cache hits), three are longer
    than one step's budget (chunked prefill); greedy, ``max_tokens`` each."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab_size, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (3, 9)]
    prompts += [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (1, 37, 70)]
    return prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
