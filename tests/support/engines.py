"""``make_engine``: the default-model engine the mesh tests build, with keyword overrides."""

from __future__ import annotations

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine


def make_engine(**overrides) -> LLMEngine:
    """A float32 engine on the default model; keyword overrides go to the configs."""
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=overrides.pop("kv_cache_memory_bytes", 256 << 20),
                        num_blocks=overrides.pop("num_blocks", None),
                        enable_kv_events=overrides.pop("enable_kv_events", True))  # as `meshserve executor`
    batch = BatchSchedulerConfig(
        max_num_seqs=overrides.pop("max_num_seqs", 32),
        max_num_batched_tokens=overrides.pop("max_num_batched_tokens", 512),
        enable_chunked_prefill=overrides.pop("enable_chunked_prefill", True),
    )
    overrides.setdefault("max_model_len", 1024)  # keeps limit tests (C11) fast on a CPU
    return LLMEngine(EngineConfig(model="default", dtype="float32", cache=cache, batch=batch, **overrides))
