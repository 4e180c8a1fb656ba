"""Scale to zero over the real gateway and scheduler (case C44's caller side), no model:
a request that finds no executor waits (it is queued, the planner asks for an
executor), and when none is ready within the start budget it ends with HTTP 503
and Retry-After, not a hang. The scheduler runs on a fake clock, so the 30 s
budget passes at once."""

import asyncio

import httpx2 as httpx

from gateway.request import ModelInfo
from gateway.server import start_gateway
from scheduler.config import SchedulerConfig
from scheduler.planner import PlannerConfig
from scheduler.server import start_scheduler
from tests.support.mesh_harness import wait_for_condition


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_a_request_at_zero_executors_waits_then_gets_503_with_retry_after_past_the_start_budget(tokenizer):
    """C44: start budget 30 s, no executor ever ready: the request is queued (not refused),
    the planner's reactive floor asks for one executor, and at 30 s the caller gets 503
    ``service_unavailable`` with Retry-After naming the start budget."""
    clock = Clock()
    scheduler = await start_scheduler(0, config=SchedulerConfig(start_budget_s=30.0), clock=clock,
                                      planner=PlannerConfig(interval_s=1.0, season_s=3600.0, min_executors=0,
                                                            predictive=False))
    gateway = await start_gateway(tokenizer, ModelInfo("default", 1024, tokenizer.vocab_size), scheduler.address, 0,
                                  http_port=0)
    core, planner = scheduler.servicer.core, scheduler.servicer.planner
    try:
        async with httpx.AsyncClient(base_url=gateway.http.url, timeout=60) as http:
            call = asyncio.create_task(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
            await wait_for_condition(lambda: len(core) == 1, 30, "the request queued at 0 executors")
            clock.t += 1.0  # one planner interval
            decision = await scheduler.servicer.planner_loop.tick()
            assert decision.desired == 1 and decision.reactive == 1  # an executor is asked for
            assert not call.done()
            clock.t += 29.0  # the start budget, from its arrival
            r = await call
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        body = r.json()["error"]
        assert body["code"] == "service_unavailable" and "start budget of 30 s" in body["message"]
        assert len(core) == 0 and planner.desired == 1  # the executor asked for is not given up yet
    finally:
        await gateway.stop(0)
        await gateway.servicer.close()
        await scheduler.stop(0)
