"""The systems ``meshserve bench`` can measure, behind one small interface (``target.Target``).

* ``engine``: our ``AsyncEngine`` in this process (no gRPC, no other process):
  the engine's own speed under continuous batching.
* ``mesh``: the whole mesh (gateway → scheduler → executor) launched as
  processes with ``meshserve.cli.launcher.Mesh``, or a running gateway (``--addr``);
  requests go as ``prompt_token_ids`` through ``meshserve.client``.
* ``hf-generate``, ``hf-continuous``, ``hf-static``: ``transformers`` on the same
  folder and dtype (``meshserve.bench.hf_targets``), the references a serving
  engine must beat.

Each target's ``send`` returns the token arrival times measured in this process,
and proves the token count with ``checked_result``. The engine targets also
expose their engine counters (``read_stats``) for the KV and prefix-cache figures.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path

from meshserve.bench.config import BenchConfig
from meshserve.bench.engine_stats import CounterSnapshot
from meshserve.bench.hf_targets import HFContinuousTarget, HFGenerateTarget, HFStaticTarget
from meshserve.bench.loop import RequestResult, checked_result
from meshserve.bench.target import Target, resolve_dtype
from meshserve.bench.vllm_target import VLLMTarget
from meshserve.bench.workload import BenchRequest
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.options import parse_bytes
from meshserve.client import build_request, channel, generate
from meshserve.sampling import SamplingParams
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2_grpc

__all__ = ["TARGET_CLASSES", "Target", "make_target", "resolve_dtype"]


class EngineTarget(Target):
    """The in-process ``AsyncEngine``, driven by the same event loop as the benchmark."""

    engine = None

    async def start(self) -> None:
        from executor.engine.async_engine import AsyncEngine
        from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
        from executor.engine.llm_engine import LLMEngine

        c = self.config
        cfg = EngineConfig(
            model=c.model, dtype=c.dtype, seed=c.workload.seed, num_threads=c.threads,
            cache=CacheConfig(block_size=c.block_size, kv_cache_memory_bytes=parse_bytes(c.kv_cache_memory),
                              enable_prefix_caching=c.enable_prefix_caching),
            batch=BatchSchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                       max_batch_wait_ms=c.max_batch_wait_ms,
                                       long_prefill_token_threshold=c.long_prefill_token_threshold,
                                       **({} if c.short_prefill_tokens is None else
                                          {"short_prefill_tokens": c.short_prefill_tokens}),
                                       **({} if c.prefill_order is None else {"prefill_order": c.prefill_order})),
            compile=c.compile,
            warm_up=True,  # as the executor's CLI runs it
        )
        llm = await asyncio.to_thread(LLMEngine, cfg)
        self.engine = AsyncEngine(llm)
        await self.engine.start()
        # the start-up heap out of the cyclic collector while it serves, as the executor's CLI does and as
        # vLLM's engine core does in-process too (freeze_gc_heap at start-up, gc.unfreeze at shutdown)
        gc.collect()
        gc.freeze()

    async def send(self, req: BenchRequest) -> RequestResult:
        s = req.sampling
        params = SamplingParams(max_tokens=req.output_len, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                min_p=s.min_p, seed=s.seed, ignore_eos=req.ignore_eos)
        times: list[float] = []
        submit = time.monotonic()
        async for out in self.engine.generate(req.request_id, list(req.prompt_token_ids), params):
            now = time.monotonic()
            times.extend([now] * len(out.new_token_ids))
        return checked_result(req, submit, times, time.monotonic())

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            gc.unfreeze()

    def processes(self) -> dict[str, int]:
        return {"engine": os.getpid()}  # its busiest thread: the engine's step loop

    async def read_stats(self) -> list[CounterSnapshot]:
        """The engine's latest counters (``AsyncEngine.stats``, refreshed after every step)."""
        return [CounterSnapshot.of(self.engine.stats())]

    def describe(self) -> dict:
        if self.engine is None:
            return {**super().describe(), **self._engine_settings()}
        llm = self.engine.engine
        settings = self._engine_settings()
        settings["engine"].update(num_blocks=llm.num_blocks, block_size=llm.block_size,
                                  short_prefill_tokens=llm.config.batch.short_prefill_tokens,
                                  prefill_order=llm.config.batch.prefill_order)
        return {"dtype": str(llm.dtype).removeprefix("torch."), **settings}


class MeshTarget(Target):
    """The mesh: launched here (1 executor by default, logs in a temp folder) or at ``--addr``."""

    def __init__(self, config: BenchConfig, model_path: Path):
        super().__init__(config, model_path)
        self.mesh = None
        self.log_dir: Path | None = None
        self._channel = None
        self.stub = None
        self._executor_channels: list = []
        self._executor_stubs: list = []

    async def start(self) -> None:
        address = self.config.addr or await self._launch()
        tls = self._client_tls()
        self._channel = channel(address, tls)
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)
        executors = self.mesh.executor_addresses if self.mesh is not None else self.config.executor_addrs
        self._executor_channels = [channel(a, tls) for a in executors]
        self._executor_stubs = [executor_pb2_grpc.ExecutorStub(ch) for ch in self._executor_channels]

    def _client_tls(self) -> TLSConfig:
        """The client certificate of ``tls_dir`` (mutual TLS), or plaintext."""
        if self.config.tls_dir is None:
            return PLAINTEXT
        return TLSConfig.from_dir(self.config.tls_dir, "client")

    async def _launch(self) -> str:
        c = self.config
        self.log_dir = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
        args = ["--dtype", c.dtype, "--kv-cache-memory", c.kv_cache_memory, "--max-num-seqs", str(c.max_num_seqs),
                "--max-num-batched-tokens", str(c.max_num_batched_tokens), "--block-size", str(c.block_size),
                "--max-batch-wait-ms", str(c.max_batch_wait_ms),
                "--long-prefill-token-threshold", str(c.long_prefill_token_threshold)]
        if c.short_prefill_tokens is not None:
            args += ["--short-prefill-tokens", str(c.short_prefill_tokens)]
        if c.prefill_order is not None:
            args += ["--prefill-order", c.prefill_order]
        if not c.enable_prefix_caching:
            args.append("--no-prefix-caching")
        if c.compile:
            args.append("--compile")
        # --num-threads comes from threads_per_executor
        self.mesh = Mesh(MeshConfig(port=0, executors=c.executors, model=c.model, executor_args=args,
                                    log_dir=self.log_dir, threads_per_executor=c.threads,
                                    tls_dir=Path(c.tls_dir) if c.tls_dir else None,
                                    cpu_affinity=c.cpu_affinity))
        await self.mesh.start()
        return self.mesh.gateway_address

    async def send(self, req: BenchRequest) -> RequestResult:
        s = req.sampling
        request = build_request(list(req.prompt_token_ids), max_tokens=req.output_len, temperature=s.temperature,
                                top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                                ignore_eos=req.ignore_eos)
        submit = time.monotonic()
        out = await generate(self.stub, request)
        return checked_result(req, submit, out.token_times, time.monotonic())

    def processes(self) -> dict[str, int]:
        """The launched mesh's executors (none for a mesh at ``--addr``)."""
        if self.mesh is None:
            return {}
        return {name: proc.pid for name, proc in self.mesh.procs if name.startswith("executor")}

    async def read_stats(self) -> list[CounterSnapshot] | None:
        """Every executor's counters through its ``Stats`` RPC (the launched mesh's
        executors, or ``--executor-addr``); None when no executor is known."""
        if not self._executor_stubs:
            return None
        replies = await asyncio.gather(*(s.Stats(executor_pb2.StatsRequest(), timeout=10.0)
                                         for s in self._executor_stubs))
        return [CounterSnapshot.of(r) for r in replies]

    async def stop(self) -> None:
        for ch in [self._channel, *self._executor_channels]:
            if ch is not None:
                await ch.close()
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.stop)

    def describe(self) -> dict:
        if self.config.addr:  # the running mesh's dtype is its own; we only know what was asked
            return {"dtype": self.config.dtype, "addr": self.config.addr,
                    "executor_addrs": list(self.config.executor_addrs)}
        return {**super().describe(), **self._engine_settings(), "executors": self.config.executors,
                "log_dir": str(self.log_dir), "cpus": dict(self.mesh.cpus) if self.mesh is not None else {},
                "cpu_note": self.mesh.cpu_note if self.mesh is not None else ""}


TARGET_CLASSES: dict[str, type[Target]] = {"engine": EngineTarget, "mesh": MeshTarget, "hf-generate": HFGenerateTarget,
                                           "hf-continuous": HFContinuousTarget, "hf-static": HFStaticTarget,
                                           "vllm": VLLMTarget}


def make_target(config: BenchConfig, model_path: Path) -> Target:
    """The target named by ``config.target``."""
    return TARGET_CLASSES[config.target](config, model_path)
