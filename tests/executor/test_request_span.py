"""ExecuteSpans without a model: hand-built engine outputs in, exact spans out."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from executor.engine.outputs import RequestOutput
from executor.request_span import ExecuteSpans
from meshserve.sampling import SamplingParams
from meshserve.telemetry import context_from_metadata, memory_exporter

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_execute_spans_attributes_phases_and_preemption_events():
    memory_exporter().clear()
    parent = context_from_metadata([("traceparent", TRACEPARENT)])
    params = SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9, n=2)
    spans = ExecuteSpans(parent, "r1", "executor-7", "m", 40, params, priority=2)
    spans.on_output(1, RequestOutput("r1#1", [5], False, None, num_cached_tokens=32, num_kvstore_tokens=16))
    spans.on_output(0, RequestOutput("r1#0", [6], False, None, preempted_at_ns=(1_000, 2_000)))
    spans.on_output(0, RequestOutput("r1#0", [7], True, "stop"))
    spans.on_output(1, RequestOutput("r1#1", [8, 9], True, "length", preempted_at_ns=(3_000,)))
    spans.end()
    finished = {s.name: s for s in memory_exporter().get_finished_spans()}
    assert set(finished) == {"executor.execute", "executor.prefill", "executor.decode"}
    execute, prefill, decode = finished["executor.execute"], finished["executor.prefill"], finished["executor.decode"]
    assert execute.kind == SpanKind.SERVER
    assert execute.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert execute.parent.span_id == 0xB7AD6B7169203331
    assert prefill.parent.span_id == decode.parent.span_id == execute.context.span_id
    a = execute.attributes
    assert (a["meshserve.request_id"], a["meshserve.executor_id"], a["gen_ai.request.model"]) == \
        ("r1", "executor-7", "m")
    assert (a["meshserve.priority"], a["gen_ai.usage.input_tokens"], a["gen_ai.request.max_tokens"]) == (2, 40, 3)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.choice.count"]) == \
        (0.5, 0.9, 2)
    assert (a["meshserve.prefix_cache.hit_tokens"], a["meshserve.kvstore.hit_tokens"]) == (16, 16)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 32
    assert a["gen_ai.usage.output_tokens"] == 5 and a["meshserve.preemptions"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("stop", "length")
    assert a["meshserve.prefill_s"] >= 0 and a["meshserve.decode_s"] >= 0
    events = [(e.name, e.timestamp, e.attributes["meshserve.choice"], e.attributes["meshserve.preemptions"])
              for e in execute.events]
    assert events == [("meshserve.preempted", 1_000, 0, 1), ("meshserve.preempted", 2_000, 0, 2),
                      ("meshserve.preempted", 3_000, 1, 3)]
    assert [e.name for e in prefill.events] == ["first_token"]
    assert (prefill.attributes["meshserve.prefix_cache.hit_tokens"],
            prefill.attributes["meshserve.kvstore.hit_tokens"]) == (16, 16)
    assert prefill.end_time <= decode.start_time


def test_a_failed_call_ends_its_spans_with_an_error_status():
    memory_exporter().clear()
    spans = ExecuteSpans(context_from_metadata([]), "r2", "e", "m", 4, SamplingParams(max_tokens=2), priority=0)
    spans.end(RuntimeError("engine died"))
    finished = {s.name: s for s in memory_exporter().get_finished_spans()}
    assert set(finished) == {"executor.execute", "executor.prefill"}
    execute = finished["executor.execute"]
    assert execute.status.status_code.name == "ERROR" and execute.status.description == "RuntimeError: engine died"
    assert execute.attributes["gen_ai.response.finish_reasons"] == ("unfinished",)
    assert execute.attributes["gen_ai.usage.output_tokens"] == 0 and execute.attributes["meshserve.decode_s"] == 0.0
    assert execute.parent is None
