"""The systems ``meshserve bench`` can measure, behind one small interface.

* ``engine``: our ``AsyncEngine`` in this process (no gRPC, no other process):
  the engine's own speed under continuous batching.
* ``mesh``: the whole mesh (gateway → scheduler → executor) launched as
  processes with ``meshserve.launcher.Mesh``, or a running gateway (``--addr``);
  requests go as ``prompt_token_ids`` through ``meshserve.client``.
* ``hf-generate``: ``transformers`` ``generate`` on the same folder and dtype,
  one request at a time, greedy: the reference a serving engine must beat.

Each target's ``send`` returns the token arrival times measured in this process,
and proves the token count with ``checked_result``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path

from meshserve.bench.config import BenchConfig
from meshserve.bench.loop import BenchError, RequestResult, checked_result
from meshserve.bench.workload import BenchRequest


def resolve_dtype(dtype: str) -> str:
    """The dtype a target runs in: "auto" is float32, as the engine's "auto" on CPU."""
    return "float32" if dtype == "auto" else dtype


class Target(ABC):
    """A system under test: ``start``, then any number of ``send``, then ``stop``."""

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

    def describe(self) -> dict:
        """Facts for the report (resolved dtype, addresses, log folder…)."""
        return {"dtype": resolve_dtype(self.config.dtype)}

    def _engine_settings(self) -> dict:
        c = self.config
        return {"engine": {"kv_cache_memory": c.kv_cache_memory, "max_num_seqs": c.max_num_seqs,
                           "max_num_batched_tokens": c.max_num_batched_tokens, "num_threads": c.threads}}


class EngineTarget(Target):
    """The in-process ``AsyncEngine``, driven by the same event loop as the benchmark."""

    engine = None

    async def start(self) -> None:
        from executor.engine.async_engine import AsyncEngine
        from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
        from executor.engine.llm_engine import LLMEngine
        from meshserve.services import parse_bytes

        c = self.config
        cfg = EngineConfig(
            model=c.model, dtype=c.dtype, seed=c.workload.seed, num_threads=c.threads,
            cache=CacheConfig(kv_cache_memory_bytes=parse_bytes(c.kv_cache_memory)),
            batch=BatchSchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens),
        )
        llm = await asyncio.to_thread(LLMEngine, cfg)
        self.engine = AsyncEngine(llm)
        await self.engine.start()

    async def send(self, req: BenchRequest) -> RequestResult:
        from meshserve.sampling import SamplingParams

        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        times: list[float] = []
        submit = time.monotonic()
        async for out in self.engine.generate(req.request_id, list(req.prompt_token_ids), params):
            now = time.monotonic()
            times.extend([now] * len(out.new_token_ids))
        return checked_result(req, submit, times, time.monotonic())

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()

    def describe(self) -> dict:
        if self.engine is None:
            return {**super().describe(), **self._engine_settings()}
        llm = self.engine.engine
        settings = self._engine_settings()
        settings["engine"].update(num_blocks=llm.num_blocks, block_size=llm.block_size)
        return {"dtype": str(llm.dtype).removeprefix("torch."), **settings}


class MeshTarget(Target):
    """The mesh: launched here (1 executor by default, logs in a temp folder) or at ``--addr``."""

    def __init__(self, config: BenchConfig, model_path: Path):
        super().__init__(config, model_path)
        self.mesh = None
        self.log_dir: Path | None = None
        self._channel = None
        self.stub = None

    async def start(self) -> None:
        from meshserve.client import channel
        from meshserve.v1 import gateway_pb2_grpc

        address = self.config.addr or await self._launch()
        self._channel = channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def _launch(self) -> str:
        from meshserve.launcher import Mesh, MeshConfig, free_port

        c = self.config
        self.log_dir = Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
        args = ["--dtype", c.dtype, "--kv-cache-memory", c.kv_cache_memory, "--max-num-seqs", str(c.max_num_seqs),
                "--max-num-batched-tokens", str(c.max_num_batched_tokens)]
        # --num-threads comes from threads_per_executor
        self.mesh = Mesh(MeshConfig(port=free_port(), executors=c.executors, model=c.model, executor_args=args,
                                    log_dir=self.log_dir, threads_per_executor=c.threads))
        await self.mesh.start()
        return self.mesh.gateway_address

    async def send(self, req: BenchRequest) -> RequestResult:
        from meshserve.client import build_request, generate

        request = build_request(list(req.prompt_token_ids), max_tokens=req.output_len, temperature=0.0,
                                ignore_eos=True)
        submit = time.monotonic()
        out = await generate(self.stub, request)
        return checked_result(req, submit, out.token_times, time.monotonic())

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.stop)

    def describe(self) -> dict:
        if self.config.addr:  # the running mesh's dtype is its own; we only know what was asked
            return {"dtype": self.config.dtype, "addr": self.config.addr}
        return {**super().describe(), **self._engine_settings(), "executors": self.config.executors,
                "log_dir": str(self.log_dir)}


class _TokenClock:
    """A ``transformers`` streamer that records when each generated token is sampled.

    ``generate`` calls ``put`` once with the prompt, then once per step with that
    step's new token(s); the first call after the prompt is the first token, so
    TTFT covers the prefill and the first sampling inside one ``generate`` call.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.extend([time.monotonic()] * value.numel())

    def end(self) -> None:
        pass


class HFGenerateTarget(Target):
    """``AutoModelForCausalLM.generate``, one request at a time, greedy, exact output length.

    TTFT is the time the streamer receives the first generated token (see ``_TokenClock``).
    """

    model = None

    async def start(self) -> None:
        self.model = await asyncio.to_thread(self._load)

    def _load(self):
        import torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, resolve_dtype(self.config.dtype))
        torch.set_num_threads(self.config.threads)  # the same cores as the engine targets
        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).eval()

    async def send(self, req: BenchRequest) -> RequestResult:
        return await asyncio.to_thread(self._generate, req)

    def _generate(self, req: BenchRequest) -> RequestResult:
        import torch

        ids = torch.tensor([req.prompt_token_ids], dtype=torch.long)
        eos = self.model.generation_config.eos_token_id
        clock = _TokenClock()
        submit = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=req.output_len,
                min_new_tokens=req.output_len, streamer=clock,
                pad_token_id=eos[0] if isinstance(eos, list) else eos,
                temperature=None, top_p=None, top_k=None,
            )
        end = time.monotonic()
        generated = out.shape[1] - ids.shape[1]
        if generated != len(clock.times):
            raise BenchError(f"streamer saw {len(clock.times)} tokens but generate returned {generated}")
        return checked_result(req, submit, clock.times, end)

    async def stop(self) -> None:
        self.model = None


TARGET_CLASSES: dict[str, type[Target]] = {"engine": EngineTarget, "mesh": MeshTarget, "hf-generate": HFGenerateTarget}


def make_target(config: BenchConfig, model_path: Path) -> Target:
    """The target named by ``config.target``."""
    return TARGET_CLASSES[config.target](config, model_path)
