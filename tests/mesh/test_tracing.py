"""One trace across gateway, scheduler and executor, rooted at the caller's context."""

import asyncio

import pytest

from meshserve.client import build_request, generate
from meshserve.telemetry import memory_exporter

pytestmark = pytest.mark.model

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"
EXPECTED = {"gateway.generate", "scheduler.admit", "executor.execute", "executor.prefill", "executor.decode"}


async def test_one_trace_across_services(mesh):
    memory_exporter().clear()
    out = await generate(mesh.stub, build_request(chat=[("user", "Hi")], max_tokens=6, temperature=0),
                         metadata=(("traceparent", TRACEPARENT),))
    assert len(out.token_ids) >= 1
    for _ in range(200):
        spans = [s for s in memory_exporter().get_finished_spans() if s.context.trace_id == TRACE_ID]
        if EXPECTED <= {s.name for s in spans}:
            break
        await asyncio.sleep(0.01)
    names = {s.name for s in spans}
    assert EXPECTED <= names, names
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert [r.name for r in roots] == ["gateway.generate"]
    assert roots[0].parent.span_id == PARENT_SPAN_ID and roots[0].parent.is_remote
    gateway_span = roots[0]
    assert gateway_span.attributes["gen_ai.usage.output_tokens"] == len(out.token_ids)
    assert any(e.name == "first_token" for s in spans for e in s.events)
