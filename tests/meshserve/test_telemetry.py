"""The trace sampler: ParentBased(TraceIdRatioBased(ratio)), ratio by argument or
MESHSERVE_TRACE_SAMPLE_RATIO, validated."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from meshserve.telemetry import make_sampler

# 1000 trace ids at the centres of 1000 equal slices of the low 64 bits (what the ratio compares)
IDS = [((2 * i + 1) << 64) // 2000 for i in range(1000)]


def sampled(sampler, parent=None) -> int:
    return sum(sampler.should_sample(parent, trace_id, "x").decision == Decision.RECORD_AND_SAMPLE
               for trace_id in IDS)


def parent_context(sampled_flag: bool):
    ctx = SpanContext(0x1234, 0x5678, is_remote=True,
                      trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled_flag else TraceFlags.DEFAULT))
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def test_ratio_keeps_that_fraction_of_root_traces(monkeypatch):
    monkeypatch.delenv("MESHSERVE_TRACE_SAMPLE_RATIO", raising=False)
    assert sampled(make_sampler()) == 1000          # default 1: every trace
    assert sampled(make_sampler(0.0)) == 0
    assert sampled(make_sampler(0.25)) == 250       # the ids are evenly spread: exactly a quarter
    monkeypatch.setenv("MESHSERVE_TRACE_SAMPLE_RATIO", "0.5")
    assert sampled(make_sampler()) == 500


def test_the_callers_decision_wins():
    assert sampled(make_sampler(0.0), parent_context(True)) == 1000
    assert sampled(make_sampler(1.0), parent_context(False)) == 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, "abc", "nan"])
def test_a_ratio_outside_0_1_is_a_value_error(bad, monkeypatch):
    with pytest.raises(ValueError, match="trace sample ratio"):
        make_sampler(bad)
    monkeypatch.setenv("MESHSERVE_TRACE_SAMPLE_RATIO", str(bad))
    with pytest.raises(ValueError, match="trace sample ratio"):
        make_sampler()


def test_a_bad_ratio_stops_a_service_with_one_line():
    from typer.testing import CliRunner

    from meshserve.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["scheduler", "--port", "0", "--trace-sample-ratio", "1.5"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--trace-sample-ratio" in result.output
    result = runner.invoke(app, ["scheduler", "--port", "0", "--insecure"],
                           env={"MESHSERVE_TRACE_SAMPLE_RATIO": "lots"})
    assert result.exit_code == 1
    assert result.output.strip() == "error: trace sample ratio must be a number in [0, 1], got 'lots'"
