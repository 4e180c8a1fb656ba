"""Requests and hand-built runner outputs for tests of the executor's batch scheduler (schedule →
update_from_output without a model)."""

from __future__ import annotations

import itertools

from executor.engine.batch_scheduler import BatchScheduler
from executor.engine.outputs import RequestOutput
from executor.engine.request import Request
from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from meshserve.sampling import SamplingParams

_arrivals = itertools.count()


def make_request(request_id: str, num_prompt: int, max_tokens: int = 16, priority: int = 0,
                 max_len: int = 10_000, **params) -> Request:
    """A request with prompt ``[0, 1, ..., num_prompt - 1]`` (mod 100)."""
    params.setdefault("ignore_eos", True)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id, [i % 100 for i in range(num_prompt)], sampling, priority, next(_arrivals), max_len)


def run_step(scheduler: BatchScheduler, token: int = 7) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """schedule() then update_from_output() with ``token`` sampled for every request
    that samples; checks the KV invariants after the step."""
    out = scheduler.schedule()
    runner = ModelRunnerOutput({s.request_id: token for s in out.scheduled if s.sample})
    results = scheduler.update_from_output(out, runner)
    scheduler.kv.check_integrity()
    return out, results


def shares(out: SchedulerOutput) -> dict[str, int]:
    """request id -> tokens scheduled this step."""
    return {s.request_id: s.num_scheduled_tokens for s in out.scheduled}


def finish_all(scheduler: BatchScheduler) -> list[dict[str, int]]:
    """Steps (``run_step``) until no request is left; each step's ``shares``. Every KV block
    must be free at the end."""
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(shares(run_step(scheduler)[0]))
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    return steps
