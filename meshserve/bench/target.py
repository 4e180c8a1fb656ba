"""The interface every ``meshserve bench`` target implements.

A target starts, runs requests to their last token, reports the engine counters
it can see, and stops. ``run`` is the closed loop (or, given arrival times, the
open loop) by default; a target that batches on its own (``hf-static``) overrides it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

from meshserve.bench.config import BenchConfig
from meshserve.bench.engine_stats import CounterSnapshot
from meshserve.bench.loop import RequestResult, ResultFn, run_closed_loop, run_open_loop
from meshserve.bench.workload import BenchRequest


def resolve_dtype(dtype: str) -> str:
    """The dtype a target runs in: "auto" is float32, as the engine's "auto" on CPU."""
    return "float32" if dtype == "auto" else dtype


class Target(ABC):
    """A system under test.

    Args:
        config: the run's configuration.
        model_path: the resolved model folder (config, tokenizer, safetensors).
    """

    def __init__(self, config: BenchConfig, model_path: Path):
        self.config = config
        self.model_path = model_path

    @abstractmethod
    async def start(self) -> None:
        """Loads the model / starts the services; returns once requests can be sent."""

    @abstractmethod
    async def send(self, req: BenchRequest) -> RequestResult:
        """Runs one request to its last token (greedy, ``ignore_eos``, exactly ``req.output_len`` tokens).

        Raises:
            BenchError: the target produced a different number of tokens.
        """

    @abstractmethod
    async def stop(self) -> None:
        """Frees what ``start`` took; safe to call after a failed ``start``."""

    async def run(
        self, requests: Sequence[BenchRequest], concurrency: int, arrivals: Sequence[float] | None = None,
        on_result: ResultFn | None = None,
    ) -> tuple[list[RequestResult], float]:
        """Runs ``requests`` with at most ``concurrency`` in flight (``run_closed_loop`` over
        ``send``), or, given ``arrivals`` (seconds from the start, one per request), each
        at its arrival (``run_open_loop``; ``concurrency`` is then unused).

        Args:
            on_result: called with each result as it finishes.

        Returns:
            The results in workload order and the wall-clock seconds of the run.
        """
        if arrivals is not None:
            return await run_open_loop(requests, arrivals, self.send, on_result)
        return await run_closed_loop(requests, concurrency, self.send, on_result)

    async def read_stats(self) -> list[CounterSnapshot] | None:
        """The engine counters of every engine behind the target (one per executor), or
        None when the target has no such counters (the transformers targets)."""
        return None

    def processes(self) -> dict[str, int]:
        """The processes that run this system's engine, by name (``meshserve.bench.cpu_wait``
        reports how long their busiest thread waited for a CPU); {} when unknown."""
        return {}

    def describe(self) -> dict:
        """Facts for the report (resolved dtype, addresses, log folder…)."""
        return {"dtype": resolve_dtype(self.config.dtype)}

    def _engine_settings(self) -> dict:
        c = self.config
        return {"engine": {"kv_cache_memory": c.kv_cache_memory, "max_num_seqs": c.max_num_seqs,
                           "max_num_batched_tokens": c.max_num_batched_tokens, "num_threads": c.threads,
                           "block_size": c.block_size, "enable_prefix_caching": c.enable_prefix_caching,
                           "max_batch_wait_ms": c.max_batch_wait_ms, "compile": c.compile,
                           "long_prefill_token_threshold": c.long_prefill_token_threshold,
                           "short_prefill_tokens": c.short_prefill_tokens, "prefill_order": c.prefill_order}}
