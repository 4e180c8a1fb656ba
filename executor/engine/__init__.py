"""The executor's scheduling side: requests, the iteration-level batch scheduler,
the paged KV cache's blocks and prefix cache, and the step loop that drives a
worker group (``executor.worker``) with plain data, behind ``LLMEngine``
(synchronous) and ``AsyncEngine`` (a background thread for asyncio servers)."""

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.outputs import EngineStats, RequestOutput

__all__ = ["BatchSchedulerConfig", "CacheConfig", "EngineConfig", "EngineStats", "RequestOutput"]
