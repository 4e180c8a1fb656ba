"""The closed loop that drives a target, and what one request's timing looks like.

Closed loop (the model of vLLM's and SGLang's ``--max-concurrency`` runs): C
workers share one list of requests; each takes the next request, waits for its
last token, and takes the next, until the list is empty. At most C requests are
in flight at any time and the offered load adapts to the server's speed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from meshserve.bench.workload import BenchRequest


class BenchError(RuntimeError):
    """A request's result is not what the workload asked for (wrong token count…)."""


@dataclass(frozen=True)
class RequestResult:
    """What one request did, as the benchmark's client saw it.

    Attributes:
        request_id: the workload's id.
        prompt_len: prompt tokens sent.
        output_len: tokens actually received.
        submit_time: ``time.monotonic()`` when the request was handed to the target.
        token_times: ``time.monotonic()`` when each output token arrived (one
            entry per token; tokens of one message share a time).
        end_time: ``time.monotonic()`` when the request finished.
    """

    request_id: str
    prompt_len: int
    output_len: int
    submit_time: float
    token_times: tuple[float, ...]
    end_time: float

    @property
    def ttft_s(self) -> float:
        """Seconds from submit to the first output token."""
        return self.token_times[0] - self.submit_time

    @property
    def tpot_s(self) -> float:
        """Mean seconds between output tokens after the first (0.0 for one token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def e2e_s(self) -> float:
        """Seconds from submit to the end of the request."""
        return self.end_time - self.submit_time


def checked_result(
    req: BenchRequest, submit_time: float, token_times: Sequence[float], end_time: float
) -> RequestResult:
    """A ``RequestResult`` for ``req``, once it is proved to hold exactly ``req.output_len`` tokens.

    Raises:
        BenchError: the target produced a different number of tokens.
    """
    if len(token_times) != req.output_len:
        raise BenchError(f"request {req.request_id}: asked for exactly {req.output_len} tokens "
                         f"(ignore_eos, greedy) but received {len(token_times)}")
    return RequestResult(req.request_id, len(req.prompt_token_ids), len(token_times), submit_time,
                         tuple(token_times), end_time)


SendFn = Callable[[BenchRequest], Awaitable[RequestResult]]


async def run_closed_loop(
    requests: Sequence[BenchRequest], concurrency: int, send: SendFn
) -> tuple[list[RequestResult], float]:
    """Runs every request through ``send`` with at most ``concurrency`` in flight.

    Returns:
        The results in workload order, and the wall-clock seconds from the first
        submit to the last finish.

    Raises:
        ValueError: ``concurrency`` < 1.
        BenchError / any error of ``send``: the first failure; the other workers
            are cancelled (asyncio.TaskGroup).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(enumerate(requests))  # shared: one event loop, so next() is never concurrent
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        for i, req in pending:
            results[i] = await send(req)

    start = time.monotonic()
    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(requests))):
            group.create_task(worker())
    wall = time.monotonic() - start
    return [r for r in results if r is not None], wall
