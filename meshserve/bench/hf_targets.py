"""The ``transformers`` references, on the same model folder, dtype and torch threads.

* ``hf-generate``: ``model.generate``, one request at a time (in the open loop,
  arrivals queue for it and their TTFT includes the wait).
* ``hf-static``: ``model.generate`` on static batches of ``concurrency`` requests
  taken in workload order, left-padded; a batch runs until its longest request
  is done, then the next starts (what serving looked like before continuous
  batching); it has no open loop, and does not wait for a multi-turn parent inside
  a batch. Every request of a batch is submitted when the batch starts, gets
  its first token when the batch does (one prefill for all), and ends when
  ``generate`` returns, however few tokens it asked for; the tokens a request
  did not ask for are computed but not counted.
* ``hf-continuous``: transformers' own continuous batching
  (``model.init_continuous_batching``, the ``ContinuousBatchingManager`` behind
  ``generate_batch``): requests stream in (``add_request(streaming=True)``) through
  the closed loop like the engine's, and each token's arrival is timed through
  ``register_result_handler``, so TTFT and TPOT are real per-request figures.
  Its paged KV cache gets the same byte budget as the engine
  (``--kv-cache-memory``) in transformers' default page size, its step the same
  token and request limits, and block sharing follows ``--no-prefix-caching``.

All greedy with an exact output length: ``min_new_tokens = max_new_tokens`` for
``generate``, no EOS (``eos_token_id=-1``) for the continuous batching manager.
``check_hf_workload`` refuses, before anything starts, a workload file's requests
that sample or stop at EOS.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from meshserve.bench.loop import BenchError, RequestResult, ResultFn, checked_result
from meshserve.bench.target import Target, resolve_dtype
from meshserve.bench.workload import BenchRequest
from meshserve.cli.options import parse_bytes

# Seconds without any output after which hf-continuous checks its worker is alive.
_CB_POLL_S = 5.0


def check_hf_workload(target: str, requests: Sequence[BenchRequest], open_loop: bool) -> None:
    """Raises ValueError when the transformers ``target`` cannot run ``requests`` as asked:
    a request that samples (temperature > 0) or may stop at EOS, or hf-static in the open loop."""
    if target == "hf-static" and open_loop:
        raise ValueError("hf-static runs static batches and has no open loop (--request-rate); "
                         "use hf-generate or hf-continuous")
    for r in requests:
        if not r.sampling.greedy or not r.ignore_eos:
            raise ValueError(f"{target} runs greedy requests with ignore_eos only; {r.request_id} asks "
                             f"temperature {r.sampling.temperature:g}, ignore_eos {str(r.ignore_eos).lower()}")


class _StepClock:
    """A ``transformers`` streamer that records when each decoding step's tokens are sampled.

    ``generate`` calls ``put`` once with the prompt, then once per step with that
    step's new token of every sequence of the batch; the first call after the
    prompt is the first token, so TTFT covers the prefill and the first sampling
    inside one ``generate`` call.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


class _HFModelTarget(Target):
    """Loads ``AutoModelForCausalLM`` in the run's dtype on the run's torch threads."""

    model = None

    async def start(self) -> None:
        self.model = await asyncio.to_thread(self._load)

    def _load(self):
        import torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, resolve_dtype(self.config.dtype))
        torch.set_num_threads(self.config.threads)  # the same cores as the engine targets
        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).eval()

    async def stop(self) -> None:
        self.model = None


class HFGenerateTarget(_HFModelTarget):
    """``model.generate``, one request at a time (TTFT: see ``_StepClock``)."""

    _lock: asyncio.Lock | None = None

    async def send(self, req: BenchRequest) -> RequestResult:
        """Runs ``req`` alone; a request sent while another runs waits (its submit time is
        when it was sent, so the wait counts in its TTFT)."""
        self._lock = self._lock or asyncio.Lock()
        submit = time.monotonic()
        async with self._lock:
            result = (await asyncio.to_thread(self._generate_batch, [req]))[0]
        return RequestResult(result.request_id, result.prompt_len, result.output_len, submit, result.token_times,
                             result.end_time)

    def _generate_batch(self, reqs: Sequence[BenchRequest]) -> list[RequestResult]:
        """One ``generate`` call over ``reqs`` (left-padded), until the longest is done.

        Raises:
            BenchError: ``generate`` returned another number of tokens than asked.
        """
        import torch

        eos = self.model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in reqs])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in reqs])
        num_new = max(r.output_len for r in reqs)
        clock = _StepClock()
        submit = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new,
                                      min_new_tokens=num_new, streamer=clock, pad_token_id=pad,
                                      temperature=None, top_p=None, top_k=None)
        end = time.monotonic()
        generated = out.shape[1] - width
        if not generated == len(clock.times) == num_new:
            raise BenchError(f"asked generate for {num_new} tokens; it returned {generated}, "
                             f"the streamer saw {len(clock.times)} steps")
        return [checked_result(r, submit, clock.times[:r.output_len], end) for r in reqs]


class HFStaticTarget(HFGenerateTarget):
    """``model.generate`` on static batches of ``concurrency`` requests (see the module doc)."""

    async def run(
        self, requests: Sequence[BenchRequest], concurrency: int, arrivals: Sequence[float] | None = None,
        on_result: ResultFn | None = None,
    ) -> tuple[list[RequestResult], float]:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if arrivals is not None:
            raise ValueError("hf-static has no open loop")
        results: list[RequestResult] = []
        start = time.monotonic()
        for i in range(0, len(requests), concurrency):
            batch = await asyncio.to_thread(self._generate_batch, requests[i:i + concurrency])
            for r in batch:
                if on_result is not None:
                    on_result(r)
            results += batch
        return results, time.monotonic() - start


class HFContinuousTarget(_HFModelTarget):
    """transformers' ``ContinuousBatchingManager``, fed by the closed loop (see the module doc)."""

    manager = None
    _attn_implementation: str | None = None

    async def start(self) -> None:
        await super().start()
        self.manager = await asyncio.to_thread(self._start_manager)

    def _start_manager(self):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        c, cfg = self.config, self.model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        page_size = ContinuousBatchingConfig().page_size  # transformers' default
        bytes_per_page = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.model.dtype.itemsize
                          * page_size)
        cb_config = ContinuousBatchingConfig(
            num_blocks=max(1, parse_bytes(c.kv_cache_memory) // bytes_per_page),
            max_batch_tokens=c.max_num_batched_tokens, max_requests_per_batch=c.max_num_seqs,
            allow_block_sharing=c.enable_prefix_caching)
        manager = self.model.init_continuous_batching(
            generation_config=GenerationConfig(do_sample=False, eos_token_id=-1), continuous_batching_config=cb_config)
        manager.warmup()  # as continuous_batching_context_manager does (a no-op without CUDA graphs)
        manager.start()
        self._attn_implementation = self.model.config._attn_implementation  # stop() restores the original
        return manager

    async def send(self, req: BenchRequest) -> RequestResult:
        outputs: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(req.request_id, outputs.put_nowait)
        submit = time.monotonic()
        accepted = self.manager.add_request(list(req.prompt_token_ids), request_id=req.request_id,
                                            max_new_tokens=req.output_len, streaming=True, eos_token_id=-1)
        if accepted is None:
            raise BenchError(f"request {req.request_id}: the continuous batching manager refused it")
        times: list[float] = []
        while True:
            out = await self._next_output(req.request_id, outputs)
            now = time.monotonic()
            times.extend([now] * (len(out.generated_tokens) - len(times)))
            if out.is_finished():
                return checked_result(req, submit, times, time.monotonic())

    async def _next_output(self, request_id: str, outputs: asyncio.Queue):
        """The request's next ``GenerationOutput`` (cumulative ``generated_tokens``).

        Raises:
            BenchError: the request failed, or the manager's worker died.
        """
        while True:
            try:
                out = await asyncio.wait_for(outputs.get(), _CB_POLL_S)
            except TimeoutError:
                fatal = self.manager.background_thread_status.fatal_error
                if fatal is not None or not self.manager.is_running():
                    raise BenchError(f"request {request_id}: the continuous batching worker stopped "
                                     f"({fatal})") from None
                continue
            if out.error is not None:
                raise BenchError(f"request {request_id} failed in continuous batching: {out.error}")
            return out

    async def stop(self) -> None:
        if self.manager is not None:
            manager = self.manager
            await asyncio.to_thread(lambda: (manager.stop(block=True, timeout=30), manager.destroy()))
        await super().stop()

    def describe(self) -> dict:
        facts = super().describe()
        if self.manager is not None:
            cb = self.manager.continuous_batching_config
            facts["hf_continuous"] = {
                "page_size": cb.page_size, "num_blocks": cb.num_blocks, "max_batch_tokens": cb.max_batch_tokens,
                "max_requests_per_batch": cb.max_requests_per_batch, "allow_block_sharing": cb.allow_block_sharing,
                "attn_implementation": self._attn_implementation, "scheduler": cb.scheduler_type,
                "num_threads": self.config.threads}
        return facts
