"""The executor's engine: paged KV cache, iteration-level batch scheduler, model
runner and sampler, behind ``LLMEngine`` (synchronous) and ``AsyncEngine``
(a background thread for asyncio servers)."""

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.outputs import EngineStats, RequestOutput

__all__ = ["BatchSchedulerConfig", "CacheConfig", "EngineConfig", "EngineStats", "RequestOutput"]
