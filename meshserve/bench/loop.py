"""The loops that drive a target, and what one request's timing looks like.

Closed loop (the model of vLLM's and SGLang's ``--max-concurrency`` runs): C
workers share one list of requests; each takes the next request, waits for its
last token, and takes the next, until the list is empty. At most C requests are
in flight at any time and the offered load adapts to the server's speed.

Open loop (``--request-rate``): request ``i`` is sent at its arrival offset
(``meshserve.bench.arrivals``) whatever is in flight, so the offered load is
fixed and queueing shows in the latencies.

In both, a request with a ``parent_id`` (a multi-turn conversation's next turn)
is sent only once its parent has finished; its submit time is when it is sent.
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
    """A ``RequestResult`` for ``req``, once it is proved to hold exactly ``req.output_len`` tokens
    (``req.ignore_eos``; otherwise between 1 and ``req.output_len``).

    Raises:
        BenchError: the target produced another number of tokens.
    """
    if req.ignore_eos and len(token_times) != req.output_len:
        raise BenchError(f"request {req.request_id}: asked for exactly {req.output_len} tokens "
                         f"(ignore_eos) but received {len(token_times)}")
    if not 1 <= len(token_times) <= req.output_len:
        raise BenchError(f"request {req.request_id}: asked for 1 to {req.output_len} tokens "
                         f"but received {len(token_times)}")
    return RequestResult(req.request_id, len(req.prompt_token_ids), len(token_times), submit_time,
                         tuple(token_times), end_time)


SendFn = Callable[[BenchRequest], Awaitable[RequestResult]]
ResultFn = Callable[[RequestResult], None]


class _Parents:
    """Sends a request only after its parent finished (``BenchRequest.parent_id``), and
    tells ``on_result`` of every result."""

    def __init__(self, requests: Sequence[BenchRequest], send: SendFn, on_result: ResultFn | None):
        ids = {r.request_id for r in requests}
        missing = sorted({r.parent_id for r in requests if r.parent_id is not None} - ids)
        if missing:
            raise ValueError(f"parent request(s) {', '.join(missing)} are not in the workload")
        self._done = {r.request_id: asyncio.Event() for r in requests}
        self._send, self._on_result = send, on_result

    async def send(self, req: BenchRequest) -> RequestResult:
        if req.parent_id is not None:
            await self._done[req.parent_id].wait()
        result = await self._send(req)
        self._done[req.request_id].set()
        if self._on_result is not None:
            self._on_result(result)
        return result


async def run_closed_loop(
    requests: Sequence[BenchRequest], concurrency: int, send: SendFn, on_result: ResultFn | None = None
) -> tuple[list[RequestResult], float]:
    """Runs every request through ``send`` with at most ``concurrency`` in flight.

    A request whose parent has not finished holds its worker until it has (the
    parent, earlier in the list, is already in flight, so this never deadlocks).

    Args:
        on_result: called with each result as it finishes (the progress bar).

    Returns:
        The results in workload order, and the wall-clock seconds from the first
        submit to the last finish.

    Raises:
        ValueError: ``concurrency`` < 1, or a ``parent_id`` not in ``requests``.
        BenchError / any error of ``send``: the first failure; the other workers
            are cancelled (asyncio.TaskGroup).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gated = _Parents(requests, send, on_result)
    pending = iter(enumerate(requests))  # shared: one event loop, so next() is never concurrent
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        for i, req in pending:
            results[i] = await gated.send(req)

    start = time.monotonic()
    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(requests))):
            group.create_task(worker())
    wall = time.monotonic() - start
    return [r for r in results if r is not None], wall


async def run_open_loop(
    requests: Sequence[BenchRequest], arrivals: Sequence[float], send: SendFn, on_result: ResultFn | None = None
) -> tuple[list[RequestResult], float]:
    """Sends request ``i`` at ``arrivals[i]`` seconds after the start, however many are in flight.

    A request whose parent has not finished by its arrival is sent when the parent
    finishes.

    Args:
        arrivals: one non-decreasing offset (seconds) per request
            (``meshserve.bench.arrivals.poisson_arrivals``).
        on_result: called with each result as it finishes.

    Returns:
        The results in workload order, and the wall-clock seconds from the start
        (the first arrival) to the last finish.

    Raises:
        ValueError: ``arrivals`` and ``requests`` differ in length, or a ``parent_id``
            not in ``requests``.
        BenchError / any error of ``send``: the first failure; the requests still in
            flight are cancelled (asyncio.TaskGroup).
    """
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(requests)} requests")
    gated = _Parents(requests, send, on_result)
    start = time.monotonic()
    tasks = []
    async with asyncio.TaskGroup() as group:
        for req, offset in zip(requests, arrivals):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(group.create_task(gated.send(req)))
    wall = time.monotonic() - start
    return [t.result() for t in tasks], wall
