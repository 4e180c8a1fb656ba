"""Graceful scale-down through the real mesh: a draining executor finishes its
in-flight request, new requests go to the other executor, no caller sees an error (C42)."""

import asyncio

import pytest

from executor.drain import drain
from executor.server import start_executor
from meshserve.client import build_request, generate
from tests.support.engines import make_engine
from tests.support.mesh_harness import StepGate, start_local_mesh, wait_for_condition

pytestmark = pytest.mark.model

PROMPT = [1000 + (i * 7919) % 40000 for i in range(40)]
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


async def test_draining_executor_finishes_in_flight_work_and_new_requests_go_elsewhere(tokenizer):
    engine_x, engine_y = make_engine(), make_engine()
    m = await start_local_mesh([engine_x], tokenizer)
    svc_x, _, link_x = m.executors[0]
    core = m.scheduler.servicer.core
    try:
        with StepGate(engine_x) as gate:
            held = asyncio.create_task(gate.hold(after_steps=engine_x.num_steps + 1))
            in_flight = asyncio.create_task(generate(m.stub, build_request(PROMPT, **GREEDY), timeout=600))
            await held  # x has run the first step of the request and is held before the next
            svc_y, async_y, link_y = await start_executor(engine_y, 0, scheduler_address=m.scheduler.address,
                                                          executor_id="executor-1", tls=m.tls("executor"))
            m.executors.append((svc_y, async_y, link_y))
            draining = asyncio.create_task(drain(svc_x, svc_x.servicer, link_x, grace_s=600.0))
            await wait_for_condition(link_x.drain_acked.is_set, 60, "drain acknowledged")
            assert core.registry.get("executor-0").draining
            new = await asyncio.gather(*(generate(m.stub, build_request(PROMPT[:30 + i], **GREEDY), timeout=600)
                                         for i in range(3)))
            assert [r.executor_id for r in new] == ["executor-1"] * 3
            assert not draining.done() and not link_x.drained.is_set()  # x still runs its request
            gate.release()
        first = await in_flight
        assert first.executor_id == "executor-0" and len(first.token_ids) == 12
        assert await asyncio.wait_for(draining, 600) is True
        assert link_x.drained.is_set()
        again = await generate(m.stub, build_request(PROMPT, **GREEDY), timeout=600)
        assert again.executor_id == "executor-1" and again.token_ids == first.token_ids  # same model, greedy
        await svc_x.watchdog.stop()
        await link_x.stop()  # x leaves: nothing it ran was voided
        await wait_for_condition(lambda: core.registry.get("executor-0") is None, 60, "x gone from the registry")
        assert core.num_leases() == 0
    finally:
        await m.stop()
