"""The spans of one ``Execute`` call, fed from the engine's outputs.

``executor.execute`` (kind SERVER, child of the caller's context) covers the
call; under it ``executor.prefill`` runs from the call's start to the first
token (engine queue, kvstore fetch and every prefill chunk: the request's TTFT
inside the executor) and ``executor.decode`` from there to the end. The
execute span carries the GenAI request attributes, the executor id, the prefix
cache's and the kvstore's hit tokens, the seconds spent in prefill and in
decode, the finish reasons, and one ``meshserve.preempted`` event per
preemption, stamped when the engine preempted the request (the engine reports
it with the request's next output). ``context`` is the parent of the engine's
kvstore fetch and publish spans.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from executor.engine.outputs import RequestOutput
from meshserve import trace_attributes as ta
from meshserve.sampling import SamplingParams
from meshserve.telemetry import record_error, tracer

_tracer = tracer(__name__)


class ExecuteSpans:
    """Opens the execute and prefill spans; ``on_output`` moves to decode at the first
    token; ``end`` closes them.

    Args:
        parent: the caller's context (``context_from_grpc``).
        request_id: the Execute call's request id.
        executor_id: this executor's id in the scheduler's registry.
        model_id: the model served.
        prompt_len: prompt tokens.
        params: validated sampling parameters.
        priority: the request's priority class.
    """

    def __init__(self, parent, request_id: str, executor_id: str, model_id: str, prompt_len: int,
                 params: SamplingParams, priority: int):
        self.span = _tracer.start_span("executor.execute", context=parent, kind=trace.SpanKind.SERVER, attributes={
            ta.REQUEST_ID: request_id, ta.EXECUTOR_ID: executor_id, ta.REQUEST_MODEL: model_id,
            ta.PRIORITY: priority, ta.USAGE_INPUT_TOKENS: prompt_len, **ta.sampling_attributes(params)})
        self.context = trace.set_span_in_context(self.span)
        self._phase = _tracer.start_span("executor.prefill", context=self.context)
        self._started = self._first_token = time.monotonic()
        self._decoding = False
        self._reasons: list[str | None] = [None] * params.n
        self.num_output_tokens = 0
        self.num_preemptions = 0

    def on_output(self, index: int, out: RequestOutput) -> None:
        """Takes choice ``index``'s engine output: preemption events, the first token
        (prefill → decode), token and finish counts."""
        for at_ns in out.preempted_at_ns:
            self.num_preemptions += 1
            self.span.add_event(ta.EVENT_PREEMPTED, {"meshserve.choice": index,
                                                     ta.PREEMPTIONS: self.num_preemptions}, timestamp=at_ns)
        if out.new_token_ids and not self._decoding:
            self._decoding = True
            self._first_token = time.monotonic()
            hits = {ta.PREFIX_CACHE_HIT_TOKENS: out.num_cached_tokens - out.num_kvstore_tokens,
                    ta.KVSTORE_HIT_TOKENS: out.num_kvstore_tokens}
            self._phase.set_attributes(hits)
            self._phase.add_event(ta.EVENT_FIRST_TOKEN)
            self._phase.end()
            self.span.set_attributes({**hits, ta.USAGE_CACHE_READ_INPUT_TOKENS: out.num_cached_tokens})
            self._phase = _tracer.start_span("executor.decode", context=self.context)
        self.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self._reasons[index] = out.finish_reason

    def end(self, exc: BaseException | None = None) -> None:
        """Ends both spans (``exc``: the call failed with it)."""
        now = time.monotonic()
        self._phase.end()
        self.span.set_attributes({
            ta.USAGE_OUTPUT_TOKENS: self.num_output_tokens, ta.PREEMPTIONS: self.num_preemptions,
            ta.PREFILL_S: (self._first_token if self._decoding else now) - self._started,
            ta.DECODE_S: now - self._first_token if self._decoding else 0.0,
            ta.RESPONSE_FINISH_REASONS: ta.finish_reasons(self._reasons)})
        if exc is not None:
            record_error(self.span, exc)
        self.span.end()
